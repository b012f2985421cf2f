"""Where a compiled graph finds a packed weight: one registry per custom op, keyed by a number.

torch.compile cannot trace a packed fbgemm weight (a TorchScript object): every Float16Linear would
break the graph in two, and inductor cannot lower oneDNN's prepacked op. Under compile each layer
calls an opaque custom op instead, which finds its packed weight by a number. The formats' modules
(target/packed_float16.py, packed_onednn.py, packed_mkl.py, packed_stream.py) register their weights
here and their ops look them up; one counter numbers them all, so a key is never reused while the
process runs.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

FP16_BY_KEY: dict[int, object] = {}  # headway::linear_fp16's: (packed weight, scale, prompt copy)
# headway::linear_onednn's
ONEDNN_BY_KEY: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
# headway::linear_mkl's
MKL_BY_KEY: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
_KEYS = itertools.count()


def register(registry: dict, value: Any, owner: Any) -> int:
    """A key for `value` in `registry`, dropped when `owner` is collected."""
    key = next(_KEYS)
    registry[key] = value
    weakref.finalize(owner, registry.pop, key, None)
    return key
