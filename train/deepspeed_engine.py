"""DeepSpeed ZeRO (stage 1, 2 or 3) for the head: `train.backend=deepspeed`, launched by `deepspeed`
or torchrun.

Headway's run config owns the batch, the optimizer (AdamW), the schedule and clipping; the DeepSpeed
config owns ZeRO and precision. Its "auto" fields are filled from the run config (as Hugging Face
Trainer does), and a number that contradicts the run config is refused. Checkpoints are DeepSpeed's
own sharded files, inside Headway's step directory, resumable under the same world size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from headway.errors import HeadwayError

log = logging.getLogger("headway")

PRESETS = ["zero1", "zero2", "zero3"]
# The subdirectory of a Headway checkpoint that holds DeepSpeed's files (also DeepSpeed's checkpoint
# tag).
TAG = "deepspeed"


def zero_preset(stage: int) -> dict:
    """The shipped config for ZeRO `stage` (configs/deepspeed/zero{stage}.json holds the same)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        zero.update(contiguous_gradients=True, overlap_comm=False, reduce_bucket_size=50_000_000)
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=10_000, stage3_prefetch_bucket_size=50_000_000
        )
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,
    }


def _set(cfg: dict, key: str, value: Any, source: str) -> None:
    """Fill an "auto" (or absent) field; refuse one that says otherwise than the run config."""
    section, _, name = key.rpartition(".")
    box = cfg.setdefault(section, {}) if section else cfg
    have = box.get(name, "auto")
    if have != "auto" and have != value:
        raise HeadwayError(
            f"deepspeed config {source}: {key}={have!r} contradicts the run config ({value!r}); "
            f'set it to "auto" or change the train.* setting instead'
        )
    box[name] = value


def resolve_config(source: str, tc: Any, world_size: int, bf16: bool) -> dict:
    """The DeepSpeed config for this run: a preset name (zero1/zero2/zero3) or a JSON file, with its
    "auto" fields filled from `tc` (TrainConfig)."""
    if source in PRESETS:
        cfg = zero_preset(int(source[-1]))
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise HeadwayError(
                f"train.deepspeed_config: {path} does not exist; use a file such as "
                f"configs/deepspeed/zero2.json or one of {', '.join(PRESETS)}"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise HeadwayError(f"train.deepspeed_config: {path} is not valid JSON ({e})") from None
    for owned in ("optimizer", "scheduler"):
        if owned in cfg:
            raise HeadwayError(
                f'deepspeed config {source}: remove its "{owned}" section; Headway\'s train.* settings '
                f"(lr, betas, weight_decay, warmup_steps, min_lr_ratio) define the optimizer and schedule"
            )
    if cfg.get("fp16", {}).get("enabled") in (True, "auto"):
        raise HeadwayError(
            f"deepspeed config {source}: fp16 is not supported (it needs loss scaling); use bf16"
        )
    _set(cfg, "train_micro_batch_size_per_gpu", tc.micro_batch_size, source)
    _set(cfg, "gradient_accumulation_steps", tc.grad_accum, source)
    _set(cfg, "train_batch_size", tc.micro_batch_size * tc.grad_accum * world_size, source)
    _set(cfg, "gradient_clipping", float(tc.grad_clip), source)
    if cfg.get("bf16", {}).get("enabled", "auto") == "auto":
        cfg.setdefault("bf16", {})["enabled"] = bf16
    elif bool(cfg["bf16"]["enabled"]) != bf16:
        raise HeadwayError(
            f"deepspeed config {source}: bf16.enabled={cfg['bf16']['enabled']} but train.autocast_dtype "
            f'resolves to {"bfloat16" if bf16 else "float32"}: set bf16.enabled to "auto" or change '
            "train.autocast_dtype"
        )
    return cfg


def initialize(module: torch.nn.Module, optimizer: Any, scheduler: Any, ds_config: dict) -> Any:
    """The DeepSpeed engine around the head; it takes over the optimizer and steps the schedule."""
    if next(module.parameters()).device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    try:
        import deepspeed
    except ImportError:
        raise HeadwayError(
            "train.backend=deepspeed needs DeepSpeed: pip install 'headway[deepspeed]' "
            "(on CPU also export DS_ACCELERATOR=cpu)"
        ) from None
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        dist_init_required=False,
    )
    log.info(
        "deepspeed: ZeRO stage %d, bf16 %s",
        engine.zero_optimization_stage(),
        ds_config["bf16"]["enabled"],
    )
    return engine


class DeepSpeedStep:
    """Backward and optimizer step through the engine: it scales each micro-batch by 1/grad_accum,
    reduces gradients across ranks, clips and steps at the accumulation boundary. The boundary's
    engine.step() waits for `step()`, so the loop can refuse a non-finite loss before any update."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._pending = False

    def zero_grad(self) -> None:
        """The engine zeroes gradients itself after each boundary step."""

    def accumulating(self, module: torch.nn.Module, last: bool) -> Any:
        """The engine defers its gradient reduction to the accumulation boundary itself."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self._pending:
            self.engine.step()
        self.engine.backward(loss)
        self._pending = True

    def step(self) -> torch.Tensor:
        """The boundary step; the gradient norm as a 0-dim tensor (DeepSpeed computes it on the
        host)."""
        self.engine.step()
        self._pending = False
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32)


def full_module_state(engine: Any) -> dict[str, torch.Tensor]:
    """The head's whole state on every rank, in float32 (ZeRO-3: gathered from the shards; a
    collective)."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {
            k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
            for k, v in module.state_dict().items()
        }


def save_shards(engine: Any, directory: Path) -> None:
    """Every rank writes its share of the optimizer (and ZeRO-3 parameter) state under
    directory/TAG."""
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)


def load_shards(engine: Any, checkpoint: Path, world_size: int, saved_world_size: int) -> None:
    """Restore the engine from a checkpoint written by the same number of ranks."""
    if not (checkpoint / TAG).is_dir():
        raise HeadwayError(
            f"checkpoint {checkpoint} was not written by train.backend=deepspeed: resume it with the "
            "backend that wrote it"
        )
    if saved_world_size != world_size:
        raise HeadwayError(
            f"checkpoint {checkpoint} was written by {saved_world_size} deepspeed ranks and this run has "
            f"{world_size}: resume with {saved_world_size} processes (DeepSpeed's ZeRO shards are per rank)"
        )
    path, _ = engine.load_checkpoint(
        str(checkpoint), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise HeadwayError(f"checkpoint {checkpoint}: DeepSpeed could not read {checkpoint / TAG}")
