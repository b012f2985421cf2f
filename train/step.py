"""One optimizer step: grad_accum micro-batches forward and backward, then the update, with no host
read.

A micro-batch is collated and planned on the host (the objective's index tensors,
train/objectives/), then uploaded; the target's features (online, or from the offline cache) and the
head's loss stay on the device. Losses, metrics and the gradient norm come back as device tensors.
Between accumulated micro-batches DDP and FSDP2 keep their gradients local
(`TorchStep.accumulating`).

The finite-loss check (`FiniteCheck`) reads the step's losses before its update
(train.finite_check=step, the CPU default) or one step late (lagged, the CUDA default), when the
device has long finished them, so that the host never waits on the device inside a step.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.checkpoint import checkpoint

from headway.errors import HeadwayError
from headway.runtime import autocast_dtype
from headway.train import target_features as _target_features
from headway.train.checkpointing import latest_checkpoint
from headway.train.data import Sample, Stream, collate
from headway.train.distributed import Parallel
from headway.train.feature_cache import FeatureCache
from headway.train.losses import distill_kl
from headway.train.metrics import MetricSums, read
from headway.train.objectives import Features
from headway.train.packing import collate_packed, doc_segments, pack_at
from headway.train.target_features import target_features, target_logits
from headway.train.ttt import shifted

log = logging.getLogger("headway")


def pinned(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The planned micro-batch in page-locked memory where it goes to a real CUDA device (so its
    upload is asynchronous), else as it is."""
    if device.type != "cuda" or not torch.cuda.is_available():  # (a fake CUDA device in the tests)
        return batch
    return {k: v if v.is_pinned() else v.pin_memory() for k, v in batch.items()}


def upload(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The planned micro-batch on the device (pinned and asynchronous on CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.to(device, non_blocking=True) for k, v in pinned(batch, device).items()}


def plan_batch(samples: list[Sample], pad_id: int, objective: Any) -> dict[str, torch.Tensor]:
    """The micro-batch collated (right-padded) and planned by the kind's objective, on the host."""
    batch = collate(samples, pad_id)
    return {**batch, **objective.plan(batch)}


def plan_packed(
    rows: list[list[Sample]], length: int, pad_id: int, objective: Any
) -> dict[str, torch.Tensor]:
    """The micro-batch packed into rows of `length` tokens (train/packing.py) and planned, on the
    host."""
    batch = collate_packed(rows, length, pad_id)
    return {**batch, **objective.plan(batch)}


def step_loss(
    run: "StepContext",
    planned: dict[str, torch.Tensor],
    samples: list[Sample],
    adapt: bool = False,
    checkpoint_target: bool = False,
    segments: Optional[list] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Head loss on one micro-batch, and its metrics (0-dim device tensors), with no host read.

    Args:
        run: the run's step context.
        planned: the micro-batch `plan_batch` made on the host (uploaded here).
        samples: its sequences (their keys name them in the offline feature cache).
        adapt: Medusa-2 past its heads-only warm-up: the LoRA-adapted target runs with gradients and
            a distillation loss keeps it close to the frozen target.
        checkpoint_target: with `adapt`, the adapted target's decoder layers run under activation
            checkpointing (`checkpointed_layers`; train.target_checkpointing resolved).
        segments: a packed micro-batch's sequences as (row, start, end), read on the host when it
            was planned (train/packing.py `doc_segments`): the target then attends within each
            sequence alone, with no [T, T] mask (None: padded rows, or the dense mask).
    Returns:
        (loss, metrics): a 0-dim loss to backpropagate and name -> 0-dim tensor, on the device.
    """
    target, device = run.target, run.device
    batch = upload(planned, device)
    ids = batch["input_ids"]
    compute = autocast_dtype(run.autocast, device)
    autocast = torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32)
    if run.cache is not None:
        hidden, argmax = run.cache.batch([s.key for s in samples], ids.shape[1], device)
        feats = Features(hidden, model=target.model, argmax=argmax)
    elif run.argmax_from_data and not run.plan.needs_logits and not adapt:
        # greedy data: the token after t is the target's argmax at t, so its full lm_head is not run
        with torch.no_grad(), autocast:
            hidden, _ = target_features(
                target.model,
                ids,
                run.layers,
                batch.get("positions"),
                batch.get("doc"),
                logits=False,
                segments=segments,
            )
        feats = Features(hidden, model=target.model, argmax=shifted(ids, 1))
    else:
        checkpointed = checkpointed_layers(target.model, adapt and checkpoint_target)
        with torch.set_grad_enabled(adapt), autocast, checkpointed:
            hidden, logits = target_features(
                target.model,
                ids,
                run.layers,
                batch.get("positions"),
                batch.get("doc"),
                segments=segments,
            )
        feats = Features(hidden, logits, model=target.model)
    with autocast:
        loss, metrics = run.objective(batch, feats, run.t2d)
    if adapt:
        with torch.no_grad(), target.model.disable_adapter(), autocast:
            frozen = target_logits(
                target.model, ids, batch.get("positions"), batch.get("doc"), segments=segments
            )
        kl = distill_kl(logits, frozen, batch["attention_mask"])
        metrics["loss/distill"] = kl.detach()
        loss = loss + run.distill_weight * kl
    return loss, metrics


def decoder_layers(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    """The decoder layers of a causal LM (model.model.layers), also under a PEFT wrapper; None when
    the model is laid out otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def target_checkpointing(setting: str, device: torch.device, model: Any) -> bool:
    """train.target_checkpointing resolved for Medusa-2's adapted target: auto checkpoints its
    decoder layers on CUDA, where their activations at a large target are most of a step's memory,
    and not on CPUs (no recomputation). A target with no model.layers cannot be checkpointed: an
    error when asked for, skipped under auto."""
    wanted = setting == "layers" or (setting == "auto" and device.type == "cuda")
    if wanted and decoder_layers(model) is None:
        if setting == "layers":
            raise HeadwayError(
                f"train.target_checkpointing=layers: {type(model).__name__} has no model.layers to "
                "checkpoint; set train.target_checkpointing=none"
            )
        log.warning("target: no model.layers, so its decoder layers run without checkpointing")
        return False
    return wanted


def _attention_configs(layer: torch.nn.Module) -> list[Any]:
    """The config objects `layer`'s modules read their attention implementation from."""
    seen: dict[int, Any] = {}
    for m in layer.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@contextmanager
def _attention_state(configs: list[Any], packed: dict, implementations: list[Any]) -> Iterator:
    """The attention set-up a layer's forward ran under (train/target_features.py's
    `unmasked_causal`: the configs' attention implementation and its `_packed` state, a packed
    batch's sequences), back in place while its recomputation runs in backward, after that block
    has ended: without it a packed batch's layers would recompute with plain causal attention
    across its sequences."""
    was_packed, was = dict(_target_features._packed), [c._attn_implementation for c in configs]
    _target_features._packed.clear()
    _target_features._packed.update(packed)
    for cfg, impl in zip(configs, implementations):
        cfg._attn_implementation = impl
    try:
        yield
    finally:
        _target_features._packed.clear()
        _target_features._packed.update(was_packed)
        for cfg, impl in zip(configs, was):
            cfg._attn_implementation = impl


def _checkpointed(forward: Callable, configs: list[Any]) -> Callable:
    """`forward` (a decoder layer's) under non-reentrant activation checkpointing while gradients
    are on: only its inputs are kept, and it runs again in backward (with the same RNG, autocast
    and attention set-up) to make its activations then."""

    def contexts() -> tuple[Any, Any]:
        state = dict(_target_features._packed), [c._attn_implementation for c in configs]
        return contextlib.nullcontext(), _attention_state(configs, *state)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


@contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside the block, each decoder layer of `model` runs under activation checkpointing
    (`_checkpointed`): Medusa-2's adapted target keeps one [B, T, h] input per layer for backward
    instead of every layer's activations. The gradients are the unchecked run's. A no-op when not
    `enabled` or when the model has no `decoder_layers`."""
    layers = decoder_layers(model) if enabled else None
    if layers is None:
        yield
        return
    own = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = _checkpointed(layer.forward, _attention_configs(layer))
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


@dataclass
class StepContext:
    """What every micro-batch of the run needs: the target, the wrapped objective (the module DDP,
    FSDP or DeepSpeed wraps) and the kind's objective that plans batches on the host."""

    target: Any
    objective: Any
    plan: Any
    t2d: Optional[torch.Tensor]
    device: torch.device
    layers: list[int]
    autocast: str = "auto"
    cache: Optional[FeatureCache] = None
    distill_weight: float = 0.0
    # train.target_argmax resolved: the target's argmax is the data's next token (its lm_head
    # skipped)
    argmax_from_data: bool = False


@dataclass
class StepOutcome:
    """One optimizer step's figures: device tensors, read only by a log step or the finite check."""

    step: int
    loss: torch.Tensor  # 0-dim: the mean of the micro-batches' losses
    metrics: dict[str, torch.Tensor]  # [2] each: (sum, count) over the micro-batches (`MetricSums`)
    finite: torch.Tensor  # [grad_accum] bool: each micro-batch's loss is finite
    batches: list[str]  # each micro-batch's first sequence keys (host), for the error message
    grad_norm: Optional[torch.Tensor] = None
    tokens: int = 0  # answer tokens of the global batch (host: from the samples' loss masks)
    flops: float = 0.0  # this rank's model FLOPs (host: from the batch shapes)
    end: int = 0  # the stream position after the step's sequences (the next step's `consumed`)

    def values(self) -> dict[str, torch.Tensor]:
        """Everything a log step reads, by its logged name."""
        out = {"loss": self.loss, **self.metrics}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        return out


class FiniteCheck:
    """Stops the run at a non-finite loss, naming the step, its batch and the last good checkpoint.

    mode=step reads each step's losses before its update, so a bad step changes nothing. mode=lagged
    starts the read after the step's update is queued (every rank's flag reduced on the device, then
    copied to pinned host memory behind a CUDA event) and looks at it when the next step is queued,
    when the device has long finished it: the host never waits on the device inside a step. A bad
    step's update is then applied and the run stops one step later; no checkpoint is written after
    it, since a checkpoint first reads the pending check (`settle`)."""

    def __init__(self, mode: str, ckpt_root: Path, par: Parallel):
        self.mode, self.ckpt_root, self.par = mode, ckpt_root, par
        self.pending: Optional[tuple[StepOutcome, torch.Tensor, Any]] = None

    def before_update(self, outcome: StepOutcome) -> None:
        if self.mode == "step":
            flag = self.par.mean({"finite": outcome.finite.all()})["finite"]
            self._check(outcome, float(flag), applied=False)

    def after_update(self, outcome: StepOutcome) -> None:
        if self.mode == "lagged":
            self.settle()
            flag = self.par.mean({"finite": outcome.finite.all()})["finite"]
            event = None
            if flag.is_cuda and torch.cuda.is_available():
                host = torch.empty((), dtype=flag.dtype, pin_memory=True)
                host.copy_(flag, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                flag = host
            self.pending = (outcome, flag, event)

    def settle(self) -> None:
        """Read the pending step's check now (before a checkpoint, an evaluation or the end of the
        run)."""
        if self.pending is not None:
            (outcome, flag, event), self.pending = self.pending, None
            if event is not None:
                event.synchronize()  # the copy of a step queued before the current one: long done
            self._check(outcome, float(flag), applied=True)

    def _check(self, outcome: StepOutcome, flag: float, applied: bool) -> None:
        if flag == 1.0:
            return
        local = outcome.finite.tolist()
        bad = next((k for k, ok in zip(outcome.batches, local) if not ok), None)
        loss = float(outcome.loss)
        kept = latest_checkpoint(self.ckpt_root) if self.par.is_main else None
        what = (
            "its update was applied (train.finite_check=lagged reads the loss a step late) and not saved"
            if applied
            else "nothing of this step was applied"
        )
        raise HeadwayError(
            f"loss became {loss if bad else 'non-finite'} at step {outcome.step} (batch: "
            f"{bad or 'on another rank'}); {what} and the last good checkpoint is "
            f"{kept or 'none (no checkpoint written yet)'}: lower train.lr or train.grad_clip, or check "
            "those sequences, then rerun with train.resume_from=auto"
        )


def batch_name(batch: list[Sample]) -> str:
    return f"sequences {', '.join(s.key for s in batch[:4])}{' ...' if len(batch) > 4 else ''}"


@dataclass
class StepPlan:
    """One optimizer step's micro-batches as the host prepared them: collated, planned, counted."""

    step: int
    # (planned batch, its samples, a packed batch's sequence bounds or None) per micro-batch
    micro: list[tuple[dict[str, torch.Tensor], list[Sample], Optional[list]]]
    names: list[str]  # each micro-batch's first sequence keys, for the finite check's message
    tokens: int  # answer tokens of the global batch
    flops: float  # this rank's model FLOPs
    adapt: bool  # Medusa-2's LoRA-adapted target trains this step
    end: int  # the stream position after the step's sequences (the next step's `consumed`)


class TrainStep:
    """grad_accum micro-batches forward and backward, then the optimizer step: no host read in
    between.

    `plan` does the step's host work (reading the stream, collating, the objective's index tensors,
    the counts); `run` does the device work and reads nothing back (with train.finite_check=lagged);
    calling the step does both, then hands the outcome to the lagged finite check.

    Args:
        run: the micro-batches' shared context.
        stepper: TorchStep or DeepSpeedStep (backward, the update, no_sync).
        train_set: the training sequences; a step reads the global micro-batches after `consumed` of
            them (`Stream.take`), each rank its share.
        tc: the train config (micro_batch_size, grad_accum, seed, length_window,
            target_checkpointing).
        par: the ranks.
        finite: the run's finite-loss check.
        count_flops: this rank's model FLOPs of a planned micro-batch (train/flops.py), from its
            shapes.
        lora_warmup: Medusa-2's head.medusa.lora.heads_warmup_steps (None: no adapters).
    """

    def __init__(
        self,
        run: StepContext,
        stepper: Any,
        train_set: list[Sample],
        tc: Any,
        par: Parallel,
        finite: FiniteCheck,
        count_flops: Callable[[dict], float] = lambda planned: 0.0,
        lora_warmup: Optional[int] = None,
    ):
        self.run, self.stepper, self.train_set, self.tc, self.par = run, stepper, train_set, tc, par
        self.finite, self.count_flops, self.lora_warmup = finite, count_flops, lora_warmup
        self.micro = tc.micro_batch_size * par.world_size
        # each epoch's order computed once
        self.stream = Stream(train_set, tc.seed, tc.length_window)
        self.pad_id = run.target.tokenizer.pad_token_id or 0
        # Medusa-2: its adapted target's decoder layers checkpointed (train.target_checkpointing)
        self.checkpoint_target = lora_warmup is not None and target_checkpointing(
            tc.target_checkpointing, run.device, run.target.model
        )
        # the next step's plan, made on a background thread while this step runs (plan_ahead)
        ahead = getattr(tc, "plan_ahead", "none")
        self.ahead = (
            ThreadPoolExecutor(1, thread_name_prefix="headway-plan")
            if ahead == "thread" or (ahead == "auto" and run.device.type == "cuda")
            else None
        )
        self.pending: Optional[tuple[int, int, Future]] = None

    def __call__(self, step: int, consumed: int) -> StepOutcome:
        """Step `step` (1-based), its data after `consumed` sequences of the stream; with plan-ahead
        the next step's plan starts on its thread before this step's device work."""
        plan = self._plan_for(step, consumed)
        if self.ahead is not None:
            self.pending = (step + 1, plan.end, self.ahead.submit(self.plan, step + 1, plan.end))
        outcome = self.run_planned(plan)
        self.finite.after_update(outcome)
        return outcome

    def _plan_for(self, step: int, consumed: int) -> StepPlan:
        """The plan made ahead for this step where there is one (the same data: plans are a function
        of the step and the stream position only), else one made now. Planning never runs on two
        threads at once: a plan made ahead is always collected first."""
        pending, self.pending = self.pending, None
        if pending is not None:
            made = pending[2].result()
            if pending[:2] == (step, consumed):
                return made
        return self.plan(step, consumed)

    def plan(self, step: int, consumed: int) -> StepPlan:
        """The host's part of step `step`: its micro-batches after `consumed` sequences, planned."""
        tc = self.tc
        adapt = self.lora_warmup is not None and step - 1 >= self.lora_warmup
        if tc.packing:
            return self._plan_packed(step, consumed, adapt)
        micro, names, tokens, flops = [], [], 0, 0.0
        for k in range(tc.grad_accum):
            everyone = self.stream.take(consumed + k * self.micro, self.micro)
            tokens += sum(sum(s.loss_mask) for s in everyone)
            batch = self.par.shard(everyone)
            planned = pinned(plan_batch(batch, self.pad_id, self.run.plan), self.run.device)
            flops += self.count_flops(planned)
            names.append(batch_name(batch))
            micro.append((planned, batch, None))
        return StepPlan(
            step, micro, names, tokens, flops, adapt, consumed + self.micro * tc.grad_accum
        )

    def _plan_packed(self, step: int, consumed: int, adapt: bool) -> StepPlan:
        """`plan` with packing: each global micro-batch is micro_batch_size rows per rank of
        train.pack_length tokens, filled from the stream in order; rank r takes its own rows."""
        tc, par = self.tc, self.par
        rows, length = tc.micro_batch_size, tc.pack_length or tc.max_length
        micro, names, tokens, flops, position = [], [], 0, 0.0, consumed
        for _ in range(tc.grad_accum):
            packed, position = pack_at(
                self.train_set,
                position,
                rows * par.world_size,
                length,
                tc.seed,
                tc.length_window,
                self.stream,
            )
            tokens += sum(sum(s.loss_mask) for row in packed for s in row)
            mine = packed[par.rank * rows : (par.rank + 1) * rows]
            batch = [s for row in mine for s in row]
            planned = pinned(plan_packed(mine, length, self.pad_id, self.run.plan), self.run.device)
            flops += self.count_flops(planned)
            names.append(batch_name(batch))
            # the sequences' bounds, read here on the host: the step itself reads nothing back
            micro.append((planned, batch, doc_segments(planned["doc"])))
        return StepPlan(step, micro, names, tokens, flops, adapt, position)

    def run_planned(self, plan: StepPlan) -> StepOutcome:
        """The device's part: forward and backward of each micro-batch, then the update."""
        accum = len(plan.micro)
        self.stepper.zero_grad()
        loss_sum, metrics_sum, finite = None, MetricSums(), []
        for k, (planned, batch, segments) in enumerate(plan.micro):
            with self.stepper.accumulating(self.run.objective, last=k == accum - 1):
                loss, metrics = step_loss(
                    self.run, planned, batch, plan.adapt, self.checkpoint_target, segments
                )
                self.stepper.backward(loss)
            loss = loss.detach()
            finite.append(torch.isfinite(loss))
            loss_sum = loss / accum if loss_sum is None else loss_sum + loss / accum
            metrics_sum.add(metrics)
        outcome = StepOutcome(
            plan.step,
            loss_sum,
            metrics_sum.values(),
            torch.stack(finite),
            plan.names,
            tokens=plan.tokens,
            flops=plan.flops,
            end=plan.end,
        )
        self.finite.before_update(outcome)
        outcome.grad_norm = torch.as_tensor(self.stepper.step(), device=self.run.device).float()
        return outcome


@torch.no_grad()
def evaluate(run: StepContext, held: list, tc: Any, par: Parallel = Parallel()) -> dict[str, float]:
    """Per-head top-1 / top-5 accuracy and loss on the held-out split (mean over batches and ranks;
    every rank runs the same number of batches, as FSDP's collectives need); read back once."""
    run.objective.eval()
    sums = MetricSums()
    batches = 0
    samples = held[: tc.eval_max_samples]
    samples = par.shard(samples[: len(samples) // par.world_size * par.world_size])
    pad_id = run.target.tokenizer.pad_token_id or 0
    for first in range(0, len(samples), tc.micro_batch_size):
        batch = samples[first : first + tc.micro_batch_size]
        loss, metrics = step_loss(run, plan_batch(batch, pad_id, run.plan), batch)
        sums.add({**metrics, "loss": loss})
        batches += 1
    run.objective.train()
    return read({f"eval/{k}": v for k, v in sums.values().items()}, par) if batches else {}
