"""Training checkpoints: head weights, optimizer, scheduler, each rank's RNG state and the data position.

Written to a temp directory and renamed, so a checkpoint is whole or absent. Optimizer state is
read back with torch.load(weights_only=True): tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from headway.errors import HeadwayError
from headway.io import atomic_dir, safetensors_of


def save_checkpoint(root: Path, step: int, model_state: dict, optim_state: dict, scheduler: Any, consumed: int,
                    adapters: Optional[dict] = None, rng_states: Optional[list] = None, optimizer_format: str = "index",
                    shards: Optional[dict[str, Path]] = None) -> Path:
    """Write one checkpoint (rank 0, with the states every rank helped gather). `adapters`: the target's
    trainable adapter tensors (Medusa-2); `rng_states`: each rank's torch RNG state, in rank order;
    `optimizer_format`: "index" (torch's own optimizer.state_dict) or "fqn" (gathered by parameter name,
    loadable under any backend and world size) or "deepspeed" (DeepSpeed's per-rank files, in `shards`:
    directories written by every rank, moved into the checkpoint under their names)."""
    out = root / f"step-{step:08d}"
    with atomic_dir(out) as tmp:
        save_file(safetensors_of(model_state), str(tmp / "heads.safetensors"))
        if adapters is not None:
            save_file(safetensors_of(adapters), str(tmp / "adapters.safetensors"))
        torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict(),
                    "torch_rng": rng_states or [torch.get_rng_state()]}, tmp / "state.pt")
        state = {"step": step, "consumed": consumed, "python_rng": _jsonable(random.getstate()),
                 "optimizer_format": optimizer_format, "world_size": len(rng_states or [None])}
        for name, src in (shards or {}).items():
            os.replace(src, tmp / name)
        (tmp / "trainer.json").write_text(json.dumps(state))
    return out


def _jsonable(state: Any) -> Any:
    return [_jsonable(x) for x in state] if isinstance(state, (tuple, list)) else state


def _tupled(state: Any) -> Any:
    return tuple(_tupled(x) for x in state) if isinstance(state, list) else state


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = sorted(p for p in root.glob("step-*") if (p / "trainer.json").is_file())
    return found[-1] if found else None


@dataclass
class Checkpoint:
    step: int
    consumed: int
    model_state: dict
    optim_state: dict
    optimizer_format: str
    rng_states: list
    adapters: Optional[dict]


def read_checkpoint(path: Path, scheduler: Any, with_adapters: bool) -> Checkpoint:
    """Read a checkpoint (every rank), restore the scheduler and Python RNG; the caller loads the rest."""
    files = [path / "heads.safetensors", path / "state.pt", path / "trainer.json"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise HeadwayError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}): resume from another one")
    adapters = None
    if with_adapters:
        if not (path / "adapters.safetensors").is_file():
            raise HeadwayError(f"checkpoint {path} has no adapters.safetensors but train.lora.enabled is true")
        adapters = load_file(str(path / "adapters.safetensors"))
    state = torch.load(files[1], weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    trainer = json.loads(files[2].read_text())
    random.setstate(_tupled(trainer["python_rng"]))
    rng = state["torch_rng"]
    return Checkpoint(int(trainer["step"]), int(trainer["consumed"]), load_file(str(files[0])), state["optimizer"],
                      trainer.get("optimizer_format", "index"), rng if isinstance(rng, list) else [rng], adapters)
