"""Training checkpoints: head weights, optimizer, scheduler, each rank's RNG state and the data
position.

Written to a temp directory and renamed, so a checkpoint is whole or absent. Optimizer state is
read back with torch.load(weights_only=True): tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from headway.errors import HeadwayError
from headway.faults import fault_point
from headway.io import atomic_dir, file_checksums, safetensors_of, verify_checksums

log = logging.getLogger("headway")


def save_checkpoint(
    root: Path,
    step: int,
    model_state: dict,
    optim_state: dict,
    scheduler: Any,
    consumed: int,
    adapters: Optional[dict] = None,
    rng_states: Optional[list] = None,
    optimizer_format: str = "index",
    shards: Optional[dict[str, Path]] = None,
    progress: Optional[dict] = None,
) -> Path:
    """Write one checkpoint (rank 0, with the states every rank helped gather). `adapters`: the
    target's trainable adapter tensors (Medusa-2); `rng_states`: each rank's torch RNG state
    (`rng_state`), in rank order; `optimizer_format`: "index" (torch's own optimizer.state_dict) or
    "fqn" (gathered by parameter name, loadable under any backend and world size) or "deepspeed"
    (DeepSpeed's per-rank files, in `shards`: directories written by every rank, moved into the
    checkpoint under their names); `progress`: the run's totals so far (answer tokens trained on,
    training seconds), carried across resumes."""
    out = root / f"step-{step:08d}"
    with atomic_dir(out) as tmp:
        save_file(safetensors_of(model_state), str(tmp / "heads.safetensors"))
        if adapters is not None:
            save_file(safetensors_of(adapters), str(tmp / "adapters.safetensors"))
        torch.save(
            {
                "optimizer": optim_state,
                "scheduler": scheduler.state_dict(),
                "torch_rng": rng_states or [rng_state(torch.device("cpu"))],
            },
            tmp / "state.pt",
        )
        state = {
            "step": step,
            "consumed": consumed,
            "python_rng": _jsonable(random.getstate()),
            "optimizer_format": optimizer_format,
            "world_size": len(rng_states or [None]),
            "progress": progress or {},
        }
        for name, src in (shards or {}).items():
            os.replace(src, tmp / name)
        state["files"] = file_checksums(tmp, [f.name for f in tmp.iterdir() if f.is_file()])
        fault_point(f"checkpoint-writing:{step}")
        (tmp / "trainer.json").write_text(
            json.dumps(state)
        )  # last: a checkpoint with trainer.json is complete
    return out


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch random state: the CPU generator's, and on CUDA the device's too (dropout
    and feature noise drawn there), so that a resumed GPU run draws the same noise."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Any, device: torch.device) -> None:
    """Restore `rng_state`'s state (or an older checkpoint's CPU state alone)."""
    if not isinstance(state, dict):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _jsonable(state: Any) -> Any:
    return [_jsonable(x) for x in state] if isinstance(state, (tuple, list)) else state


def _tupled(state: Any) -> Any:
    return tuple(_tupled(x) for x in state) if isinstance(state, list) else state


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint whose files match their checksums; a damaged newer one is
    named and skipped."""
    for path in sorted(
        (p for p in root.glob("step-*") if (p / "trainer.json").is_file()), reverse=True
    ):
        try:
            _verify(path)
        except HeadwayError as e:
            log.warning("skipping a damaged checkpoint: %s", e)
            continue
        return path
    return None


def _verify(path: Path) -> dict:
    """trainer.json of a checkpoint whose files are whole; otherwise the error names the file."""
    fix = "resume from an earlier checkpoint (train.resume_from=auto skips damaged ones), or delete this one"
    try:
        trainer = json.loads((path / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadwayError(f"checkpoint {path}: trainer.json is unreadable ({e}): {fix}") from None
    verify_checksums(path, trainer.get("files"), "checkpoint", fix)
    return trainer


@dataclass
class Checkpoint:
    step: int
    consumed: int
    model_state: dict
    optim_state: dict
    optimizer_format: str
    rng_states: list
    adapters: Optional[dict]
    progress: dict


def read_checkpoint(path: Path, scheduler: Any, with_adapters: bool) -> Checkpoint:
    """Read a checkpoint (every rank), restore the scheduler and Python RNG; the caller loads the
    rest."""
    files = [path / "heads.safetensors", path / "state.pt", path / "trainer.json"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise HeadwayError(
            f"checkpoint {path} is incomplete (missing {', '.join(missing)}): resume from another one"
        )
    trainer = _verify(path)
    adapters = None
    if with_adapters:
        if not (path / "adapters.safetensors").is_file():
            raise HeadwayError(
                f"checkpoint {path} has no adapters.safetensors but head.medusa.lora.enabled is true"
            )
        adapters = load_file(str(path / "adapters.safetensors"))
    try:
        state = torch.load(files[1], weights_only=True)
    except pickle.UnpicklingError as e:
        raise HeadwayError(
            f"checkpoint {path}: state.pt holds more than tensors and plain containers, which Headway "
            f"does not unpickle (it could run code): {str(e).splitlines()[0][:160]}"
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(_tupled(trainer["python_rng"]))
    rng = state["torch_rng"]
    return Checkpoint(
        int(trainer["step"]),
        int(trainer["consumed"]),
        load_file(str(files[0])),
        state["optimizer"],
        trainer.get("optimizer_format", "index"),
        rng if isinstance(rng, list) else [rng],
        adapters,
        dict(trainer.get("progress", {})),  # older checkpoints: totals restart from this resume
    )
