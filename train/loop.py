"""`headway train`: a head trained on a frozen target, as named steps read top to bottom
(torchtune's recipe shape): the run and its ranks, the target, the data, the head with its objective
and optimizer, resume, the loop, finish.

The target runs under no_grad in eval mode; its features feed the head. One optimizer step =
grad_accum micro-batches on each of world_size ranks (train/step.py), with no host read except every
`log_every` steps. Checkpoints carry everything needed to continue the same curve (train/resume.py).
"""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from headway.config import CONFIG_FILENAME, save_config
from headway.errors import HeadwayError
from headway.kinds.checkpoint import save_head
from headway.kinds.head_dir import read_head_config
from headway.run_config import RunConfig
from headway.runtime import autocast_dtype, resolve_device
from headway.target.loading import load_target
from headway.target.partial import load_partial_target
from headway.train import deepspeed_engine, flops
from headway.train.checkpointing import latest_checkpoint
from headway.train.data import Sample, drop_duplicates, load_samples, split_heldout
from headway.train.distributed import (
    HeadObjective,
    Parallel,
    TorchStep,
    held_bytes,
    shard_target,
    start,
    wrap,
)
from headway.train.feature_cache import CachedTarget, FeatureCache, training_target_dtype
from headway.train.logging import RunLogger
from headway.train.losses import target_to_draft
from headway.train.metrics import Throughput, peak_flops, read
from headway.train.objectives import OBJECTIVES
from headway.train.optim import cosine_schedule, make_optimizer
from headway.train.resume import check_same_run, gather_state, resume_from, write_checkpoint
from headway.train.setup_heads import add_lora, build_heads, copied_target_layers, feature_layers
from headway.train.step import FiniteCheck, StepContext, TrainStep, evaluate
from headway.train.ttt_flex import flex_shapes, length_buckets, limit_compiles, warm_flex

log = logging.getLogger("headway")


@dataclass
class Run:
    """The run's place: its config, output directory, ranks and this rank's device."""

    cfg: RunConfig
    out: Path
    par: Parallel

    @property
    def tc(self) -> Any:
        return self.cfg.train

    @property
    def device(self) -> torch.device:
        return self.par.device


@dataclass
class Data:
    """The training sequences, the held-out ones, and the offline feature cache (None: online)."""

    train_set: list[Sample]
    held: list[Sample]
    cache: Optional[FeatureCache]
    greedy: bool = False  # every training dataset distilled at temperature 0


@dataclass
class Model:
    """The head, its objective (wrapped for the backend) and what steps it."""

    heads: Any
    objective: Any
    context: StepContext
    optimizer: Any
    scheduler: Any
    stepper: Any
    lora: Any  # Medusa-2's LoRA settings, or None


def setup_run(cfg: RunConfig) -> Run:
    """Seeds, the process group and this rank's device (on CUDA its local rank's GPU, made current
    before anything is allocated), the output directory. A missing or broken train.init_from fails
    here, before the target loads."""
    tc = cfg.train
    if tc.init_from:
        read_head_config(Path(tc.init_from).expanduser())
    random.seed(tc.seed)
    torch.manual_seed(tc.seed)  # the same initial head on every rank
    device = resolve_device(cfg.target.device)
    ttt_attention(tc.ttt_attention, device)  # a setting this device cannot train with fails here
    par = start(tc.backend, device, tc.dist_timeout_min)
    out = Path(tc.output_dir).expanduser()
    if par.is_main:
        out.mkdir(parents=True, exist_ok=True)
    return Run(cfg, out, par)


def setup_target(run: Run) -> Any:
    """The frozen target on this rank's device, in train.target_dtype (bfloat16 on CUDA by default);
    its decoder layers sharded across ranks with train.shard_target; offline (train.features_dir)
    only its embedding, final norm and lm_head, all a head reads of it (target/partial.py)."""
    cfg, tc = run.cfg, run.tc
    dtype = training_target_dtype(tc.target_dtype, cfg.target.dtype, run.device)
    if tc.features_dir:
        offline = replace(cfg.target, device=str(run.device), dtype=dtype)
        return load_partial_target(offline, copied_target_layers(cfg.head, tc.init_from))
    # a sharded target loads on the CPU and reaches the GPU sharded (never whole on one GPU)
    device = "cpu" if tc.shard_target else str(run.device)
    target = load_target(replace(cfg.target, device=device, dtype=dtype))
    if tc.shard_target:
        shard_target(target.model, run.device)
    return target


def deduplicate(samples: list, tc: Any, par: Parallel) -> tuple[list, int]:
    """train.dedup's pass made once, on rank 0 (pure Python over every answer), and the kept
    positions
    broadcast: every rank keeps the same samples. Returns (kept pairs, how many were dropped)."""
    if not par.active or par.is_main:
        kept, dropped = drop_duplicates(samples, tc.dedup, tc.dedup_threshold)
        ids = {id(s) for _, s in kept}
        index = par.broadcast_object([i for i, (_, s) in enumerate(samples) if id(s) in ids])
        return kept, dropped
    index = par.broadcast_object(None)
    return [samples[i] for i in index], len(samples) - len(index)


def first_heads(cfg: RunConfig, target: Any, train_set: list, par: Parallel) -> Any:
    """The run's fresh head; its draft vocabulary counted over the training set on rank 0 only and
    broadcast (the other ranks build theirs with it)."""
    tc = cfg.train
    if not par.active or par.is_main:
        heads = build_heads(cfg.head, tc.init_from, target, train_set)
        d2t = getattr(heads, "d2t", None)
        par.broadcast_object(None if d2t is None else d2t.cpu())
        return heads
    return build_heads(cfg.head, tc.init_from, target, train_set, par.broadcast_object(None))


def setup_data(run: Run, target: Any) -> Data:
    """The self-distilled sequences (deduplicated), split into training and held-out ones, and the
    feature cache when training offline."""
    cfg, tc, par = run.cfg, run.tc, run.par
    samples, info = load_samples(tc.datasets, target.fingerprint, tc.max_length)
    if info["answerless"]:
        log.info(
            "dropped %d sequences with no answer token within train.max_length=%d (their prompts are that "
            "long)",
            info["answerless"],
            tc.max_length,
        )
    if tc.dedup != "none":
        samples, dropped = deduplicate(samples, tc, par)
        log.info(
            "train.dedup=%s: dropped %d duplicate answers, %d sequences left",
            tc.dedup,
            dropped,
            len(samples),
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
    cache = None
    if tc.features_dir:
        cache = FeatureCache(
            tc.features_dir,
            target.fingerprint,
            feature_layers(cfg.head, target),
            {"datasets": list(tc.datasets), "max_length": tc.max_length},
        )
        log.info("offline: the target's features come from %s", tc.features_dir)
    return Data(train_set, held, cache, info["greedy"])


def setup_model(run: Run, target: Any, data: Data) -> Model:
    """The head (fresh or from train.init_from), its kind's objective wrapped for the backend,
    Medusa-2's LoRA adapters, the optimizer (fused AdamW on CUDA), the schedule and the stepper."""
    cfg, tc, par, device = run.cfg, run.tc, run.par, run.device
    heads = first_heads(cfg, target, data.train_set, par).to(device)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, device)
    # the kind's objective reads the head's own config section (as built: the run's, resolved for
    # this target)
    attention = ttt_attention(tc.ttt_attention, device)
    longest = (tc.pack_length or tc.max_length) if tc.packing else tc.max_length
    buckets = length_buckets(tc.flex_buckets, longest) if attention == "flex" else ()
    plan = OBJECTIVES[cfg.head.kind](
        heads.cfg,
        seed=tc.seed,
        loss_chunk=loss_chunk(tc.loss_chunk, device),
        ttt_attention=attention,
        flex_buckets=buckets,
    )
    if buckets:
        warm_up_flex(heads, buckets, tc, device)
    objective = wrap(
        HeadObjective(heads, plan), par, device, autocast_dtype(tc.autocast_dtype, device)
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
    optimizer = make_optimizer(groups, tc, device)
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
        stepper = TorchStep(
            optimizer, scheduler, params, lora_params, tc.grad_clip, tc.grad_accum, par
        )
    objective.train()
    context = StepContext(
        target,
        objective,
        plan,
        t2d,
        device,
        feature_layers(cfg.head, target),
        tc.autocast_dtype,
        data.cache,
        lora.distill_weight if lora is not None else 0.0,
        argmax_from_data(tc.target_argmax, device, data.greedy),
    )
    return Model(heads, objective, context, optimizer, scheduler, stepper, lora)


def maybe_resume(run: Run, target: Any, model: Model) -> tuple[int, int, dict]:
    """(step, sequences consumed, progress totals) of the checkpoint the run continues from, or a
    fresh start's; each rank's own random stream is seeded either way."""
    tc, par = run.tc, run.par
    torch.manual_seed(tc.seed + par.rank)  # each rank's own random stream (feature noise)
    ckpt_root = run.out / "checkpoints"
    if not tc.resume_from:
        return 0, 0, {}
    path = par.broadcast_object(
        latest_checkpoint(ckpt_root) if tc.resume_from == "auto" else Path(tc.resume_from)
    )
    if path is None:
        log.info("resume_from=auto: no checkpoint in %s yet, starting fresh", ckpt_root)
        return 0, 0, {}
    if tc.resume_from == "auto":
        check_same_run(run.out / CONFIG_FILENAME, run.cfg)
    position = resume_from(
        path,
        model.objective,
        model.heads,
        model.optimizer,
        model.scheduler,
        target,
        tc,
        model.lora is not None,
        par,
    )
    log.info("resumed from %s at step %d", path, position[0])
    return position


def setup_step(run: Run, target: Any, data: Data, model: Model) -> TrainStep:
    """One optimizer step of the run, with its finite-loss check (train.finite_check) and its FLOP
    count."""
    finite = FiniteCheck(
        finite_mode(run.tc.finite_check, run.device), run.out / "checkpoints", run.par
    )
    return TrainStep(
        model.context,
        model.stepper,
        data.train_set,
        run.tc,
        run.par,
        finite,
        count_flops=flops.counter(
            model.context.plan,
            model.heads,
            target,
            online=data.cache is None,
            lm_head=not (model.context.argmax_from_data and not model.context.plan.needs_logits),
        ),
        lora_warmup=model.lora.heads_warmup_steps if model.lora is not None else None,
    )


def run_loop(
    run: Run, target: Any, data: Data, model: Model, position: tuple[int, int, dict]
) -> None:
    """Steps up to train.max_steps (or train.max_seconds): logs every log_every steps (the only
    reads of the device's figures), evaluates every eval_every, checkpoints every save_every and at
    the end."""
    cfg, tc, par = run.cfg, run.tc, run.par
    step, consumed, progress = position
    ckpt_root = run.out / "checkpoints"
    logger = None
    if par.is_main:
        save_config(cfg, run.out)
        logger = RunLogger(
            run.out / "log.jsonl", cfg.logging, cfg, resume_step=step if step > 0 else None
        )
    # one global micro-batch; each rank reads its share
    micro = tc.micro_batch_size * par.world_size
    log.info(
        "effective batch: %d %s (%d per rank x %d accumulation x %d ranks)",
        micro * tc.grad_accum,
        f"packed rows of {tc.pack_length or tc.max_length} tokens" if tc.packing else "sequences",
        tc.micro_batch_size,
        tc.grad_accum,
        par.world_size,
    )
    train_step = setup_step(run, target, data, model)
    finite = train_step.finite
    throughput = Throughput(run.device, peak_flops(run.device, tc.peak_tflops))
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=not par.is_main)
    # the run's totals over all its resumes: runs are compared by the answer tokens they trained on
    # and their wall time
    seen, earlier_s = (
        int(progress.get("answer_tokens", 0)),
        float(progress.get("wall_seconds", 0.0)),
    )
    started = time.time()
    while step < tc.max_steps:
        outcome = train_step(step + 1, consumed)
        step, consumed = step + 1, outcome.end
        if step == 1 and tc.shard_target and not tc.features_dir:
            held, whole = held_bytes(target.model)
            log.info(
                "target: rank %d holds %d of its %d parameter bytes after a forward",
                par.rank,
                held,
                whole,
            )
        seen += outcome.tokens
        throughput.add(outcome.tokens, outcome.flops)
        bar.update(1)
        progress = {
            "answer_tokens": seen,
            "wall_seconds": round(earlier_s + time.time() - started, 1),
        }
        out_of_time = False
        # rank 0's clock, so every rank stops at one step
        if tc.max_seconds and step % tc.log_every == 0:
            out_of_time = bool(par.broadcast_object(time.time() - started >= tc.max_seconds))
        last = step == tc.max_steps or out_of_time
        evaluating = tc.eval_every and (step % tc.eval_every == 0 or last) and data.held
        saving = (tc.save_every and step % tc.save_every == 0) or last
        if step % tc.log_every == 0 or step == 1:
            values = read(outcome.values(), par)  # the loop's one read of the device's figures
            bar.set_postfix(loss=f"{values['loss']:.3f}")
            if logger:
                lr = model.scheduler.get_last_lr()[0]
                logger.log({"step": step, **progress, "lr": lr, **values, **throughput.read()})
        if evaluating or saving:
            finite.settle()
        if evaluating:
            result = evaluate(model.context, data.held, tc, par)
            if logger:
                logger.log({"step": step, **progress, **result})
            log.info(
                "step %d eval: %s",
                step,
                " ".join(
                    f"{k.split('/', 1)[1]}={v:.3f}"
                    for k, v in result.items()
                    if "top" in k or "tau" in k
                ),
            )
        if saving:
            write_checkpoint(
                ckpt_root,
                step,
                consumed,
                model.objective,
                model.heads,
                model.optimizer,
                model.scheduler,
                target,
                model.lora is not None,
                par,
                progress,
            )
        if out_of_time:
            log.info(
                "train.max_seconds=%s reached at step %d of %d", tc.max_seconds, step, tc.max_steps
            )
            break
    finite.settle()
    bar.close()
    if logger:
        logger.close()


def argmax_from_data(setting: str, device: torch.device, greedy: bool) -> bool:
    """train.target_argmax resolved: whether the target's greedy next token is read from the data
    (skipping its full lm_head); data on sampled datasets is refused, since their tokens are not the
    argmax."""
    if setting == "data" and not greedy:
        raise HeadwayError(
            "train.target_argmax=data needs datasets distilled at temperature 0 (their answer tokens are the "
            "target's argmax), and some of train.datasets were sampled: set train.target_argmax=logits or "
            "auto"
        )
    if setting == "auto":
        return greedy and device.type == "cuda"
    return setting == "data"


def warm_up_flex(heads: Any, buckets: tuple[int, ...], tc: Any, device: torch.device) -> None:
    """Flex attention's compiles bounded (a recompile-limit hit raises) and, on a GPU, all made
    before step 1 (train/ttt_flex.py)."""
    steps = getattr(heads.cfg, "ttt_steps", 1)
    shapes = len(flex_shapes(buckets, steps))
    limit_compiles(shapes)
    if device.type == "cuda" and torch.cuda.is_available():
        started = time.time()
        config = heads.decoder.config
        warm_flex(
            config,
            tc.micro_batch_size,
            buckets,
            steps,
            autocast_dtype(tc.autocast_dtype, device),
            device,
        )
        log.info(
            "flex attention: %d shapes (buckets %s) compiled in %.0f s",
            shapes,
            list(buckets),
            time.time() - started,
        )


def ttt_attention(setting: str, device: torch.device) -> str:
    """train.ttt_attention resolved: auto is flex (block masks, no [T, T] tensors) on CUDA and
    structured elsewhere; flex off CUDA is refused, since torch runs flex attention's backward on
    GPUs only."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "structured"
    if setting == "flex" and device.type != "cuda":
        raise HeadwayError(
            f"train.ttt_attention=flex needs a CUDA device (torch runs flex attention's backward on GPUs "
            f"only), and this run trains on {device}: use train.ttt_attention=structured or auto"
        )
    return setting


def loss_chunk(setting: int, device: torch.device) -> int:
    """train.loss_chunk resolved: auto (-1) is one pass on CPUs (the same bits as ever) and
    4,096-row chunks on CUDA, where the [n, V] tensors a full loss keeps are most of a long batch's
    memory."""
    if setting >= 0:
        return setting
    return 4096 if device.type == "cuda" else 0


def finite_mode(setting: str, device: torch.device) -> str:
    """train.finite_check resolved: auto reads each step's loss before its update on CPUs (no cost
    there) and one step late on GPUs (no stall)."""
    if setting != "auto":
        return setting
    return "lagged" if device.type == "cuda" else "step"


def finish(run: Run, target: Any, data: Data, model: Model) -> Path:
    """The trained head exported (rank 0), then the process group closed."""
    par = run.par
    head_dir = run.out / "head"
    final = _final_heads(
        run.cfg, target, data.train_set, model.objective, model.heads, model.optimizer, par
    )
    if par.is_main:
        head_dir = _export(run.cfg, target, final, data, model.context.t2d, run.out)
    # the wrapped objective (DDP's reducer, FSDP, DeepSpeed) and its optimizer go before the process
    # group: freed only at interpreter exit, work they still hold on gloo can abort the process
    # after the run succeeded
    model.objective = model.optimizer = model.scheduler = model.stepper = model.context = None
    gc.collect()
    par.close()
    return head_dir


def train(cfg: RunConfig) -> Path:
    """Train a head on a frozen target, resuming from the run's latest checkpoint when there is one.

    Args:
        cfg: the run config; its target, head, train and logging sections (and features, offline)
            are read.
    Returns:
        The native head directory written at the end (`<train.output_dir>/head`; rank 0's path on
        every rank)."""
    run = setup_run(cfg)
    target = setup_target(run)
    data = setup_data(run, target)
    model = setup_model(run, target, data)
    position = maybe_resume(run, target, model)
    run_loop(run, target, data, model, position)
    return finish(run, target, data, model)


def _final_heads(
    cfg: RunConfig,
    target: Any,
    train_set: list,
    objective: Any,
    heads: Any,
    optimizer: Any,
    par: Parallel,
) -> Any:
    """The trained head as one plain module on rank 0 (FSDP, DeepSpeed: gathered from the shards;
    a collective)."""
    if par.backend not in ("fsdp", "deepspeed"):
        return heads
    model_state, _, _ = gather_state(objective, heads, optimizer, par, False)
    if not par.is_main:
        return None
    torch.manual_seed(cfg.train.seed)
    # the trained vocabulary map, not a new count over the training set: the other ranks wait in a
    # barrier
    d2t = model_state.get("d2t")
    final = build_heads(cfg.head, cfg.train.init_from, target, train_set, d2t).to(target.device)
    final.load_state_dict(model_state)
    return final


def _export(cfg: RunConfig, target: Any, heads: Any, data: Data, t2d: Any, out: Path) -> Path:
    """Write the native head (rank 0), with the kind's calibration on the held-out split (Medusa's
    per-rank accuracy, for the tree builder; offline, from their cached features)."""
    tc, held = cfg.train, data.held
    extra = {"trained_steps": tc.max_steps, "datasets": tc.datasets}
    calibrate = OBJECTIVES[cfg.head.kind].calibrate
    if held and calibrate and tc.shard_target:
        log.warning(
            "train.shard_target: the target is sharded, so rank 0 cannot measure the heads' "
            "per-rank accuracy alone; the head is saved without it (generate uses inference.tree)"
        )
    elif held and calibrate:
        calib = held[: tc.eval_max_samples]
        source = target if data.cache is None else CachedTarget(target, data.cache, calib)
        extra["rank_accuracy"] = calibrate(source, heads, calib, tc.micro_batch_size, t2d)
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
