"""The training loop, readable top to bottom: frozen target features in, head loss out.

The target runs under no_grad in eval mode; its features feed the head. One optimizer step =
grad_accum micro-batches on each of world_size ranks. Checkpoints carry everything needed to continue
the same curve.
"""

from __future__ import annotations

import gc
import logging
import math
import random
import shutil
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from headway.config import CONFIG_FILENAME, read_renamed_keys, save_config
from headway.errors import HeadwayError
from headway.faults import fault_point
from headway.heads.draft_layer import draft_layer_config, text_config
from headway.kinds.checkpoint import load_head, save_head
from headway.kinds.config import HeadConfig
from headway.kinds.head_dir import read_head_config
from headway.kinds.registry import head_kind
from headway.run_config import RunConfig
from headway.runtime import autocast_dtype
from headway.target.loading import load_target
from headway.target.packed_model import linear_weights
from headway.train import deepspeed_engine
from headway.train.checkpointing import latest_checkpoint, read_checkpoint, save_checkpoint
from headway.train.data import (
    Sample,
    batch_at,
    collate,
    drop_duplicates,
    load_samples,
    split_heldout,
    token_frequencies,
)
from headway.train.distributed import (
    HeadObjective,
    Parallel,
    TorchStep,
    full_state,
    load_full_state,
    shard_target,
    start,
    wrap,
)
from headway.train.feature_cache import FeatureCache
from headway.train.logging import RunLogger
from headway.train.losses import distill_kl, target_to_draft
from headway.train.objectives import Features

log = logging.getLogger("headway")


def add_lora(model: Any, lora: Any) -> Any:
    """Wrap the frozen target with trainable LoRA adapters (peft)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if linear_weights(model) != "native":
        raise HeadwayError(
            f"Medusa-2's LoRA adapts the target's linear layers, which target.linear_weights="
            f"{linear_weights(model)} packs for inference: train with target.linear_weights=native"
        )
    try:
        return get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                bias="none",
            ),
        )
    except ValueError as e:
        raise HeadwayError(
            f"head.medusa.lora.target_modules {list(lora.target_modules)} do not fit this target: {e}"
        ) from None


def adapter_state(model: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def cosine_schedule(optimizer: Any, warmup: int, total: int, min_ratio: float) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def kind_config(head: HeadConfig, num_layers: int) -> Any:
    """The head kind's config (the `head` section's own) with defaults resolved for this target (EAGLE-3's
    feature layers: they are saved with the head)."""
    return head_kind(head.kind).for_target(head.kind_config(), num_layers)


def heads_from(head: HeadConfig, init_from: str, target: Any) -> Any:
    """The head of train.init_from, checked against the run's `head` section: same kind, same target
    (load_head refuses another) and the same shape-defining settings; its training-only settings are the
    run's."""
    path = Path(init_from).expanduser()
    kind = read_head_config(path).get("kind")
    if kind != head.kind:
        raise HeadwayError(
            f"train.init_from={path} holds a '{kind}' head, but this run trains head.kind="
            f"{head.kind}: start from a {head.kind} head, or unset train.init_from"
        )
    heads = load_head(path, target.fingerprint, device=target.device, dtype=torch.float32)
    run_cfg = kind_config(head, int(text_config(target.config).num_hidden_layers))
    free = getattr(type(run_cfg), "training_fields", ())
    added = [
        name
        for name in getattr(type(run_cfg), "added_fields", ())
        if getattr(run_cfg, name) != getattr(heads.cfg, name)
        and getattr(heads.cfg, name) == getattr(type(run_cfg)(), name)
    ]
    differ = [
        f.name
        for f in fields(run_cfg)
        if f.name not in (*free, *added) and getattr(run_cfg, f.name) != getattr(heads.cfg, f.name)
    ]
    if added and not differ:  # the head, with the parts these settings add at their initial weights
        heads = with_added_parts(heads, replace(heads.cfg, **{k: getattr(run_cfg, k) for k in added}))
        log.info(
            "train.init_from: %s start at their initial weights", ", ".join(f"head.{kind}.{k}" for k in added)
        )
    if differ:
        shown = ", ".join(f"{k}={getattr(heads.cfg, k)!r}" for k in differ)
        raise HeadwayError(
            f"train.init_from={path} was trained with head.{kind}: {shown}, which this run sets "
            f"otherwise: set those to the head's values, or unset train.init_from"
        )
    heads.cfg = replace(heads.cfg, **{k: getattr(run_cfg, k) for k in free})
    heads.attach_target(target.model)
    log.info("starting from the weights of %s", path)
    return heads.train()


def with_added_parts(heads: Any, cfg: Any) -> Any:
    """`heads` rebuilt under `cfg`, which adds parts (EAGLE-3.1's norms): every weight of `heads` kept, the
    added ones at their initial values."""
    spec = head_kind(heads.kind)
    layer_config = getattr(heads, "layer_config", None)
    grown = spec.build(cfg, heads.hidden_size, heads.vocab_size, heads.d2t, layer_config).to(heads.d2t.device)
    missing, unexpected = grown.load_state_dict(heads.state_dict(), strict=False)
    fresh = set(grown.state_dict()) - set(heads.state_dict())
    if unexpected or set(missing) != fresh:
        raise HeadwayError(f"internal: {cfg} does not only add parts to the head ({unexpected or missing})")
    return grown


def build_heads(head: HeadConfig, init_from: Optional[str], target: Any, train_samples: list) -> Any:
    """A fresh head of the `head` section for the target (or train.init_from's); a reduced vocabulary is the
    most frequent tokens the target wrote (in `train_samples`)."""
    if init_from:
        return heads_from(head, init_from, target)
    kind, spec = head.kind, head_kind(head.kind)
    text = text_config(target.config)
    hidden, vocab, num_layers = int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers)
    kind_cfg = kind_config(head, num_layers)
    d2t = None
    if spec.reduced_vocab(kind_cfg):
        size = kind_cfg.draft_vocab_size
        if size > vocab:
            if (
                size != type(kind_cfg)().draft_vocab_size
            ):  # the default fits most targets; a value set by hand must fit
                raise HeadwayError(
                    f"head.{kind}.draft_vocab_size={size} is larger than the target's vocabulary "
                    f"({vocab} tokens): set it to at most {vocab}"
                )
            size = vocab
        freq = token_frequencies(train_samples, vocab)
        d2t = torch.sort(torch.topk(freq, size).indices).values
        covered = float(freq[d2t].sum()) / max(1, int(freq.sum()))
        log.info(
            "draft vocabulary: %d tokens cover %.1f%% of the target's training tokens", size, 100 * covered
        )
    layer_config = draft_layer_config(target.config, kind_cfg.draft_layer) if spec.layered else None
    heads = spec.build(kind_cfg, hidden, vocab, d2t=d2t, layer_config=layer_config)
    heads.init_from_target(target.model)
    heads.attach_target(target.model)
    return heads


def feature_layers(head: HeadConfig, target: Any) -> list[int]:
    """The target hidden states a step needs: the head's own (from the `head` section, as build_heads
    resolves them), plus the last one (the target's logits)."""
    num_layers = int(text_config(target.config).num_hidden_layers)
    module = head_kind(head.kind).module
    return sorted(set(module.feature_layers(kind_config(head, num_layers), num_layers)) | {num_layers})


def _gather_state(
    objective: Any, heads: Any, optimizer: Any, par: Parallel, lora: bool
) -> tuple[dict, dict, str]:
    """The head's and optimizer's whole state (a collective: every rank calls it). Runs with LoRA adapters
    keep torch's own optimizer format (their optimizer also holds the target's adapters); DeepSpeed's
    optimizer state stays in its own per-rank shards."""
    if lora:
        return heads.state_dict(), optimizer.state_dict(), "index"
    if par.backend == "deepspeed":
        model_state, optim_state, fmt = deepspeed_engine.full_module_state(objective), {}, "deepspeed"
    else:
        (model_state, optim_state), fmt = full_state(objective, optimizer, par), "fqn"
    return {k.removeprefix("heads."): v for k, v in model_state.items()}, optim_state, fmt


def _checkpoint(
    root: Path,
    step: int,
    consumed: int,
    objective: Any,
    heads: Any,
    optimizer: Any,
    scheduler: Any,
    target: Any,
    adapted: bool,
    par: Parallel,
    progress: dict,
) -> None:
    model_state, optim_state, fmt = _gather_state(objective, heads, optimizer, par, adapted)
    rngs = par.gather_objects(torch.get_rng_state())
    shards = {}
    if fmt == "deepspeed":  # every rank writes its shard beside the checkpoint; rank 0 moves them in
        staging = root / f".shards-step-{step:08d}"
        if par.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        par.barrier()
        deepspeed_engine.save_shards(objective, staging)
        par.barrier()
        shards = {deepspeed_engine.TAG: staging / deepspeed_engine.TAG}
    if par.is_main:
        save_checkpoint(
            root,
            step,
            model_state,
            optim_state,
            scheduler,
            consumed,
            adapter_state(target.model, adapted),
            rngs,
            fmt,
            shards,
            progress,
        )
        if shards:
            shutil.rmtree(root / f".shards-step-{step:08d}", ignore_errors=True)
    par.barrier()
    fault_point(f"checkpoint:{step}")


# What a checkpoint's weights and data order depend on: a resumed run must agree on all of them (the batch may
# be split differently: the data position is counted in sequences).
RUN_IDENTITY = (
    "head",
    "target.name_or_path",
    "train.datasets",
    "train.max_length",
    "train.seed",
    "train.length_window",
    "train.dedup",
    "train.dedup_threshold",
)
# Settings within RUN_IDENTITY that a resumed run may still change: Medusa's loss and decay (they could be
# changed as train.loss and train.decay, before they moved into the head section).
RESUME_MAY_CHANGE = ("head.medusa.loss", "head.medusa.decay")


def _check_same_run(saved: Path, cfg: RunConfig) -> None:
    """Refuse to continue a run written with another head, data or batch (train.resume_from=auto)."""
    if not saved.is_file():
        return
    from omegaconf import OmegaConf

    old, new = read_renamed_keys(RunConfig, OmegaConf.load(saved), str(saved)), OmegaConf.structured(cfg)
    try:  # a key the saved config lacks was written before it existed: it had the default then
        old = OmegaConf.merge(OmegaConf.structured(RunConfig()), old)
    except Exception:  # a key since removed: compare what both have
        pass
    for key in RESUME_MAY_CHANGE:
        OmegaConf.update(old, key, OmegaConf.select(new, key), merge=False)
    changed = [k for k in RUN_IDENTITY if OmegaConf.select(old, k) != OmegaConf.select(new, k)]
    if changed:
        raise HeadwayError(
            f"{saved.parent} holds checkpoints of a run with other settings ({', '.join(changed)} changed): "
            "rerun with the original values, use another train.output_dir, or set train.resume_from=null "
            "to start over there"
        )


def _resume(
    path: Path,
    objective: Any,
    heads: Any,
    optimizer: Any,
    scheduler: Any,
    target: Any,
    tc: Any,
    adapted: bool,
    par: Parallel,
) -> tuple[int, int, dict]:
    ck = read_checkpoint(path, scheduler, adapted)
    if par.backend == "deepspeed":
        deepspeed_engine.load_shards(objective, path, par.world_size, len(ck.rng_states))
    elif ck.optimizer_format == "deepspeed":
        raise HeadwayError(
            f"checkpoint {path} was written by train.backend=deepspeed: resume it with train.backend="
            f"deepspeed and {len(ck.rng_states)} processes"
        )
    elif ck.optimizer_format == "index":
        if par.backend == "fsdp":
            raise HeadwayError(
                f"checkpoint {path} was written by a Medusa-2 or older run: resume it without fsdp"
            )
        heads.load_state_dict(ck.model_state)
        optimizer.load_state_dict(ck.optim_state)
    else:
        load_full_state(
            objective, optimizer, {f"heads.{k}": v for k, v in ck.model_state.items()}, ck.optim_state, par
        )
    if ck.adapters is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(target.model, ck.adapters)
    if len(ck.rng_states) == par.world_size:
        torch.set_rng_state(ck.rng_states[par.rank])
    else:
        log.warning(
            "checkpoint %s was written by %d ranks, this run has %d: random streams (feature noise) restart",
            path,
            len(ck.rng_states),
            par.world_size,
        )
        torch.manual_seed(tc.seed + 1000 * ck.step + par.rank)
    return ck.step, ck.consumed, ck.progress


def _step_loss(
    cfg: RunConfig,
    target: Any,
    objective: Any,
    samples: list[Sample],
    t2d: Any,
    device: Any,
    adapt: bool = False,
    cache: Optional[FeatureCache] = None,
) -> tuple[torch.Tensor, dict]:
    """Head loss on one micro-batch. The target's features come from running it, or from the offline
    `cache`; with `adapt` (Medusa-2) the LoRA-adapted target runs with gradients and a distillation
    loss keeps it close to the frozen target."""
    batch = {k: v.to(device) for k, v in collate(samples, target.tokenizer.pad_token_id or 0).items()}
    ids, attn = batch["input_ids"], batch["attention_mask"]
    compute = autocast_dtype(cfg.train.autocast_dtype, device)
    autocast = torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32)
    if cache is not None:
        hidden, argmax = cache.batch([s.key for s in samples], ids.shape[1], device)
        feats = Features(hidden, model=target.model, argmax=argmax)
    else:
        with torch.set_grad_enabled(adapt), autocast:
            out = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        feats = Features(
            {i: out.hidden_states[i] for i in feature_layers(cfg.head, target)},
            out.logits,
            model=target.model,
        )
    with autocast:
        loss, metrics = objective(batch, feats, t2d)
    if adapt:
        with torch.no_grad(), target.model.disable_adapter(), autocast:
            frozen = target.model(input_ids=ids, attention_mask=attn).logits
        kl = distill_kl(out.logits, frozen, attn)
        metrics["loss/distill"] = float(kl.detach())
        loss = loss + cfg.target_lora().distill_weight * kl
    return loss, metrics


@torch.no_grad()
def evaluate(
    cfg: RunConfig,
    target: Any,
    objective: Any,
    held: list,
    t2d: Any,
    device: Any,
    cache: Optional[FeatureCache] = None,
    par: Parallel = Parallel(),
) -> dict:
    """Per-head top-1 / top-5 accuracy and loss on the held-out split (mean over batches and ranks; every
    rank runs the same number of batches, as FSDP's collectives need)."""
    objective.eval()
    sums: dict[str, float] = {}
    batches = 0
    samples = held[: cfg.train.eval_max_samples]
    samples = par.shard(samples[: len(samples) // par.world_size * par.world_size])
    for first in range(0, len(samples), cfg.train.micro_batch_size):
        loss, metrics = _step_loss(
            cfg,
            target,
            objective,
            samples[first : first + cfg.train.micro_batch_size],
            t2d,
            device,
            cache=cache,
        )
        metrics["loss"] = float(loss)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    objective.train()
    return par.mean({f"eval/{k}": v / batches for k, v in sums.items()}) if batches else {}


def train(cfg: RunConfig) -> Path:
    """Train a head on a frozen target, resuming from the run's latest checkpoint when there is one.

    Args:
        cfg: the run config; its target, head, train and logging sections (and features, offline) are read.
    Returns:
        The native head directory written at the end (`<train.output_dir>/head`; rank 0's path on
        every rank)."""
    tc = cfg.train
    out = Path(tc.output_dir).expanduser()
    if tc.init_from:
        read_head_config(
            Path(tc.init_from).expanduser()
        )  # a missing or broken head fails before the target loads
    random.seed(tc.seed)
    torch.manual_seed(tc.seed)  # the same initial head on every rank
    target = load_target(cfg.target)
    device = target.device
    par = start(tc.backend, device)
    if par.is_main:
        out.mkdir(parents=True, exist_ok=True)
    if tc.shard_target and not tc.features_dir:
        shard_target(target.model)
    samples, _ = load_samples(tc.datasets, target.fingerprint, tc.max_length)
    if tc.dedup != "none":
        samples, dropped = drop_duplicates(samples, tc.dedup, tc.dedup_threshold)
        log.info(
            "train.dedup=%s: dropped %d duplicate answers, %d sequences left", tc.dedup, dropped, len(samples)
        )
    if tc.eval_datasets:  # every training sequence trains; evaluation reads other datasets
        train_set = [s for _, s in samples]
        held = [s for _, s in load_samples(tc.eval_datasets, target.fingerprint, tc.max_length)[0]]
        log.info("evaluating on %d sequences of %s", len(held), ", ".join(tc.eval_datasets))
    else:
        train_set, held = split_heldout(samples, tc.eval_fraction)
    log.info("data: %d training sequences, %d held out", len(train_set), len(held))
    if tc.eval_every and 0 < min(len(held), tc.eval_max_samples) < par.world_size:
        log.warning(
            "only %d held-out sequence(s) for %d processes: no "
            "evaluation this run; raise train.eval_fraction or add data",
            len(held),
            par.world_size,
        )
    heads = build_heads(cfg.head, cfg.train.init_from, target, train_set).to(device)
    cache = None
    if tc.features_dir:
        cache = FeatureCache(
            tc.features_dir,
            target.fingerprint,
            feature_layers(cfg.head, target),
            {"datasets": list(tc.datasets), "max_length": tc.max_length},
        )
        log.info("offline: the target's features come from %s", tc.features_dir)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, device)
    # the kind's objective reads the head's own config section (as built: the run's, resolved for this target)
    objective = wrap(
        HeadObjective(heads, head_kind(cfg.head.kind).objective(heads.cfg, seed=tc.seed)), par, device
    )
    params = [p for p in objective.parameters() if p.requires_grad]
    groups = [{"params": params, "lr": tc.lr}]
    lora, lora_params = cfg.target_lora(), []
    if lora is not None:
        target.model = add_lora(target.model, lora)
        lora_params = [p for p in target.model.parameters() if p.requires_grad]
        groups.append({"params": lora_params, "lr": lora.lr})
        log.info(
            "Medusa-2: LoRA r=%d on %s (%d parameters), joining after %d heads-only steps",
            lora.r,
            ",".join(lora.target_modules),
            sum(p.numel() for p in lora_params),
            lora.heads_warmup_steps,
        )
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, betas=tuple(tc.betas))
    scheduler = cosine_schedule(optimizer, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    if par.backend == "deepspeed":
        bf16 = autocast_dtype(tc.autocast_dtype, device) == torch.bfloat16
        objective = deepspeed_engine.initialize(
            objective,
            optimizer,
            scheduler,
            deepspeed_engine.resolve_config(tc.deepspeed_config, tc, par.world_size, bf16),
        )
        stepper: Any = deepspeed_engine.DeepSpeedStep(objective)
    else:
        stepper = TorchStep(optimizer, scheduler, params, lora_params, tc.grad_clip, tc.grad_accum, par)
    objective.train()
    torch.manual_seed(tc.seed + par.rank)  # each rank's own random stream (feature noise)
    step, consumed, progress = 0, 0, {}
    ckpt_root = out / "checkpoints"
    if tc.resume_from:
        path = par.broadcast_object(
            latest_checkpoint(ckpt_root) if tc.resume_from == "auto" else Path(tc.resume_from)
        )
        if path is not None and tc.resume_from == "auto":
            _check_same_run(out / CONFIG_FILENAME, cfg)
        if path is None:
            log.info("resume_from=auto: no checkpoint in %s yet, starting fresh", ckpt_root)
        else:
            step, consumed, progress = _resume(
                path, objective, heads, optimizer, scheduler, target, tc, lora is not None, par
            )
            log.info("resumed from %s at step %d", path, step)
    logger = None
    if par.is_main:
        save_config(cfg, out)
        logger = RunLogger(out / "log.jsonl", cfg.logging, cfg, resume_step=step if step > 0 else None)
    micro = tc.micro_batch_size * par.world_size  # one global micro-batch; each rank reads its share
    log.info(
        "effective batch: %d sequences (%d per rank x %d accumulation x %d ranks)",
        micro * tc.grad_accum,
        tc.micro_batch_size,
        tc.grad_accum,
        par.world_size,
    )
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=not par.is_main)
    # the run's totals over all its resumes: runs are compared by the answer tokens they trained on and their
    # wall time
    seen, earlier_s = int(progress.get("answer_tokens", 0)), float(progress.get("wall_seconds", 0.0))
    started, tokens = time.time(), 0
    while step < tc.max_steps:
        stepper.zero_grad()
        adapt = lora is not None and step >= lora.heads_warmup_steps
        metrics_sum: dict[str, float] = {}
        loss_sum = 0.0
        bad_batch = None
        step_tokens = 0
        for _ in range(tc.grad_accum):
            batch = par.shard(batch_at(train_set, consumed, micro, tc.seed, tc.length_window))
            consumed += micro
            step_tokens += sum(sum(s.loss_mask) for s in batch)
            loss, metrics = _step_loss(cfg, target, objective, batch, t2d, device, adapt, cache)
            micro_loss = float(loss.detach())
            if not math.isfinite(micro_loss) and bad_batch is None:
                bad_batch = (
                    f"sequences {', '.join(s.key for s in batch[:4])}{' ...' if len(batch) > 4 else ''}"
                )
            stepper.backward(loss)
            loss_sum += micro_loss / tc.grad_accum
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v / tc.grad_accum
        tokens += step_tokens
        averaged = par.mean({"loss": loss_sum, "tokens": step_tokens, **metrics_sum})
        loss_sum = averaged.pop("loss")
        seen += round(averaged.pop("tokens") * par.world_size)
        if not math.isfinite(loss_sum):
            kept = latest_checkpoint(ckpt_root) if par.is_main else None
            raise HeadwayError(
                f"loss became {loss_sum} at step {step + 1} (batch: {bad_batch or 'on another rank'}); "
                "nothing of this step was applied and the last good checkpoint is "
                f"{kept or 'none (no checkpoint written yet)'}: lower train.lr or train.grad_clip, or check "
                "those sequences, then rerun with train.resume_from=auto"
            )
        grad_norm = stepper.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        progress = {"answer_tokens": seen, "wall_seconds": round(earlier_s + time.time() - started, 1)}
        record = {
            "step": step,
            **progress,
            "loss": loss_sum,
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens_per_s": par.world_size * tokens / max(1e-9, time.time() - started),
            **averaged,
        }
        if logger and (step % tc.log_every == 0 or step == 1):
            logger.log(record)
        if tc.eval_every and (step % tc.eval_every == 0 or step == tc.max_steps) and held:
            result = evaluate(cfg, target, objective, held, t2d, device, cache, par)
            if logger:
                logger.log({"step": step, **progress, **result})
            log.info(
                "step %d eval: %s",
                step,
                " ".join(
                    f"{k.split('/', 1)[1]}={v:.3f}" for k, v in result.items() if "top" in k or "tau" in k
                ),
            )
        if (tc.save_every and step % tc.save_every == 0) or step == tc.max_steps:
            _checkpoint(
                ckpt_root,
                step,
                consumed,
                objective,
                heads,
                optimizer,
                scheduler,
                target,
                lora is not None,
                par,
                progress,
            )
    bar.close()
    head_dir = out / "head"
    final = _final_heads(cfg, target, train_set, objective, heads, optimizer, par)
    if par.is_main:
        logger.close()
        head_dir = _export(cfg, target, final, held, t2d, out)
    # the wrapped objective (DDP's reducer, FSDP, DeepSpeed) and its optimizer go before the process group:
    # freed only at interpreter exit, work they still hold on gloo can abort the process after the
    # run succeeded
    del objective, optimizer, scheduler
    gc.collect()
    par.close()
    return head_dir


def _final_heads(
    cfg: RunConfig, target: Any, train_set: list, objective: Any, heads: Any, optimizer: Any, par: Parallel
) -> Any:
    """The trained head as one plain module on rank 0 (FSDP, DeepSpeed: gathered from the shards;
    a collective)."""
    if par.backend not in ("fsdp", "deepspeed"):
        return heads
    model_state, _, _ = _gather_state(objective, heads, optimizer, par, False)
    if not par.is_main:
        return None
    torch.manual_seed(cfg.train.seed)
    final = build_heads(cfg.head, cfg.train.init_from, target, train_set).to(target.device)
    final.load_state_dict(model_state)
    return final


def _export(cfg: RunConfig, target: Any, heads: Any, held: list, t2d: Any, out: Path) -> Path:
    """Write the native head (rank 0), with the kind's calibration on the held-out split (Medusa's per-rank
    accuracy, for the tree builder)."""
    tc = cfg.train
    extra = {"trained_steps": tc.max_steps, "datasets": tc.datasets}
    calibrate = head_kind(cfg.head.kind).calibrate
    if held and calibrate and tc.shard_target:
        log.warning(
            "train.shard_target: the target is sharded, so rank 0 cannot measure the heads' "
            "per-rank accuracy alone; the head is saved without it (generate uses inference.tree)"
        )
    elif held and calibrate:
        calib = held[: tc.eval_max_samples]
        extra["rank_accuracy"] = calibrate(target, heads, calib, tc.micro_batch_size, t2d)
        log.info(
            "measured per-rank accuracy of each head on %d held-out sequences (for the tree builder)",
            len(calib),
        )
    adapted = cfg.target_lora() is not None
    write_lora = (lambda d: target.model.save_pretrained(str(d / "lora"))) if adapted else None
    if adapted:
        extra["adapted_target"] = "lora"
    head_dir = save_head(heads, out / "head", target.fingerprint, extra, write_extra=write_lora)
    log.info("trained head written to %s", head_dir)
    return head_dir
