"""Training checkpoints: head weights, optimizer, scheduler, RNG states and the data position.

Written to a temp directory and renamed, so a checkpoint is whole or absent. Optimizer state is
read back with torch.load(weights_only=True): tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from headway.errors import HeadwayError
from headway.io import atomic_dir, safetensors_of


def save_checkpoint(root: Path, step: int, heads: Any, optimizer: Any, scheduler: Any, consumed: int,
                    adapters: Optional[dict] = None) -> Path:
    """`adapters`: the target's trainable adapter tensors (Medusa-2), saved beside the heads."""
    out = root / f"step-{step:08d}"
    with atomic_dir(out) as tmp:
        save_file(safetensors_of(heads.state_dict()), str(tmp / "heads.safetensors"))
        if adapters is not None:
            save_file(safetensors_of(adapters), str(tmp / "adapters.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, tmp / "state.pt")
        state = {"step": step, "consumed": consumed, "python_rng": _jsonable(random.getstate())}
        (tmp / "trainer.json").write_text(json.dumps(state))
    return out


def _jsonable(state: Any) -> Any:
    return [_jsonable(x) for x in state] if isinstance(state, (tuple, list)) else state


def _tupled(state: Any) -> Any:
    return tuple(_tupled(x) for x in state) if isinstance(state, list) else state


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = sorted(p for p in root.glob("step-*") if (p / "trainer.json").is_file())
    return found[-1] if found else None


def load_checkpoint(path: Path, heads: Any, optimizer: Any, scheduler: Any, adapter_model: Any = None) -> tuple[int, int]:
    """Restore everything in place; returns (step, samples consumed). `adapter_model`: the PEFT-wrapped target."""
    files = [path / "heads.safetensors", path / "state.pt", path / "trainer.json"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise HeadwayError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}): resume from another one")
    heads.load_state_dict(load_file(str(files[0])))
    if adapter_model is not None:
        from peft import set_peft_model_state_dict

        if not (path / "adapters.safetensors").is_file():
            raise HeadwayError(f"checkpoint {path} has no adapters.safetensors but train.lora.enabled is true")
        set_peft_model_state_dict(adapter_model, load_file(str(path / "adapters.safetensors")))
    state = torch.load(files[1], weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    trainer = json.loads(files[2].read_text())
    random.setstate(_tupled(trainer["python_rng"]))
    return int(trainer["step"]), int(trainer["consumed"])
