"""A head directory on disk (config.json beside model.safetensors): finding and reading its config.

Torch-free, so that every command checks the head it is given before it loads torch or the target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from headway.errors import HeadwayError


def resolve_head_dir(path: str | os.PathLike) -> Path:
    """A head directory as given, or a training run's directory's head/."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "head" / "config.json").is_file():
        return path / "head"
    return path


def read_head_config(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise HeadwayError(
            f"{p} is not a head directory (needs config.json and "
            "model.safetensors): train one with `headway train`"
        )
    try:
        return json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HeadwayError(f"{p / 'config.json'} is not valid JSON: {e}") from None
