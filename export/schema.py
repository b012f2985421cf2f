"""What an engine reads from a draft checkpoint: every tensor (name, shape, dtype) and every config
key.

A layout derives the tensors it expects from the config, as the engine's loader does; `check`
compares a checkpoint against that and names every problem, so an exporter never writes (and an
importer never reads) a checkpoint the engine would reject or load wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from headway.errors import HeadwayError

FLOAT = "float"  # any of float32 / bfloat16 / float16: engines cast to their serving dtype
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtype: str = FLOAT  # FLOAT, "int64" or "bool"
    missing: str = ""  # what an engine does without this tensor, said when it is missing

    def dtype_ok(self, t: torch.Tensor) -> bool:
        if self.dtype == FLOAT:
            return t.dtype in FLOAT_DTYPES
        return str(t.dtype).removeprefix("torch.") == self.dtype


@dataclass(frozen=True)
class Layout:
    """One engine format for one head kind."""

    name: str  # e.g. "vllm/eagle3"
    engines: str  # the loaders this layout follows, for messages and docs
    required_config: tuple[str, ...]  # keys the engine reads
    fixed_config: dict  # keys whose value the engine requires
    tensors: Callable[[dict], dict[str, Spec]]  # the expected tensors, from the config
    # cross-tensor rules (d2t, token_map)
    extra_check: Optional[Callable[[dict, dict], list[str]]] = None
    weights_file: str = "model.safetensors"  # the file the engine's loader opens
    # an engine whose file is not safetensors (llama.cpp's GGUF): (path, config, tensors, dtype) ->
    # the file, its keys in it, weights cast as the engine's converter does; and path -> (keys,
    # tensors) read back
    write: Optional[Callable[[Path, dict, dict, torch.dtype], None]] = None
    read: Optional[Callable[[Path], tuple[dict, dict]]] = None


def check(layout: Layout, config: dict, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise one HeadwayError that names every key the engine would miss, reject or misread."""
    problems = [f"config key '{k}' is missing" for k in layout.required_config if k not in config]
    problems += [
        f"config key '{k}' is {config.get(k)!r}, the engine needs {v!r}"
        for k, v in layout.fixed_config.items()
        if k in config and config[k] != v
    ]
    if not problems:
        expected = layout.tensors(config)
        problems += [
            f"tensor '{k}' is missing (expected shape {list(s.shape)})"
            + (f": {s.missing}" if s.missing else "")
            for k, s in expected.items()
            if k not in tensors
        ]
        problems += [
            f"tensor '{k}' is not part of the {layout.name} layout"
            for k in tensors
            if k not in expected
        ]
        for k, s in expected.items():
            if k not in tensors:
                continue
            t = tensors[k]
            if tuple(t.shape) != s.shape:
                problems.append(f"tensor '{k}' has shape {list(t.shape)}, expected {list(s.shape)}")
            elif not s.dtype_ok(t):
                problems.append(f"tensor '{k}' has dtype {t.dtype}, expected {s.dtype}")
        if not problems and layout.extra_check is not None:
            problems += layout.extra_check(config, tensors)
    if problems:
        raise HeadwayError(
            f"{where} does not fit {layout.name} ({layout.engines}): " + "; ".join(problems)
        )


def to_dtype(tensors: dict[str, torch.Tensor], dtype: Any) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype`, index tensors unchanged; contiguous, as safetensors needs."""
    return {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()
    }
