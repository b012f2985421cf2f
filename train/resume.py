"""Checkpoints of a running job and resuming from them: what a checkpoint holds is gathered from
every rank (train/checkpointing.py writes and reads the files), and a resumed run must be the same
run (RUN_IDENTITY)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from headway.config import read_renamed_keys
from headway.errors import HeadwayError
from headway.faults import fault_point
from headway.run_config import RunConfig
from headway.train import deepspeed_engine
from headway.train.checkpointing import read_checkpoint, rng_state, save_checkpoint, set_rng_state
from headway.train.distributed import Parallel, full_state, load_full_state
from headway.train.setup_heads import adapter_state

log = logging.getLogger("headway")


def gather_state(
    objective: Any, heads: Any, optimizer: Any, par: Parallel, lora: bool
) -> tuple[dict, dict, str]:
    """The head's and optimizer's whole state (a collective: every rank calls it). Runs with LoRA
    adapters keep torch's own optimizer format (their optimizer also holds the target's adapters);
    DeepSpeed's optimizer state stays in its own per-rank shards."""
    if lora:
        return heads.state_dict(), optimizer.state_dict(), "index"
    if par.backend == "deepspeed":
        model_state, optim_state, fmt = (
            deepspeed_engine.full_module_state(objective),
            {},
            "deepspeed",
        )
    else:
        (model_state, optim_state), fmt = full_state(objective, optimizer, par), "fqn"
    return {k.removeprefix("heads."): v for k, v in model_state.items()}, optim_state, fmt


def write_checkpoint(
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
    model_state, optim_state, fmt = gather_state(objective, heads, optimizer, par, adapted)
    rngs = par.gather_objects(rng_state(par.device))
    shards = {}
    # every rank writes its shard beside the checkpoint; rank 0 moves them in
    if fmt == "deepspeed":
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


# What a checkpoint's weights and data order depend on: a resumed run must agree on all of them (the
# batch may be split differently: the data position is counted in sequences).
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
# Settings within RUN_IDENTITY that a resumed run may still change: Medusa's loss and decay (they
# could be changed as train.loss and train.decay, before they moved into the head section).
RESUME_MAY_CHANGE = ("head.medusa.loss", "head.medusa.decay")


def check_same_run(saved: Path, cfg: RunConfig) -> None:
    """Refuse to continue a run written with another head, data or batch
    (train.resume_from=auto)."""
    if not saved.is_file():
        return
    from omegaconf import OmegaConf

    old, new = (
        read_renamed_keys(RunConfig, OmegaConf.load(saved), str(saved)),
        OmegaConf.structured(cfg),
    )
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


def resume_from(
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
            objective,
            optimizer,
            {f"heads.{k}": v for k, v in ck.model_state.items()},
            ck.optim_state,
            par,
        )
    if ck.adapters is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(target.model, ck.adapters)
    if len(ck.rng_states) == par.world_size:
        set_rng_state(ck.rng_states[par.rank], par.device)
    else:
        log.warning(
            "checkpoint %s was written by %d ranks, this run has %d: random streams (feature noise) restart",
            path,
            len(ck.rng_states),
            par.world_size,
        )
        torch.manual_seed(tc.seed + 1000 * ck.step + par.rank)
    return ck.step, ck.consumed, ck.progress
