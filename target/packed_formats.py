"""CPU inference formats for the frozen target's linear weights (decoder layers and lm_head), by
name (`PACKED`), and a packed module's kernel as a plain function of rows (`row_linear`).

Decoding a small model on a CPU reads every weight once per step, so a step costs what the memory
traffic and the kernels cost. Four formats replace every nn.Linear by a module over a prepacked
weight, each in its own module:

- `float16` (target/packed_float16.py; fbgemm's calls in target/packed_fbgemm.py): the weight packed
  as float16, float32 accumulation, a row's result that does not depend on the row count; exact bf16
  math for bfloat16 targets, the weights rounded to float16 for float32 ones.
- `onednn` (target/packed_onednn.py; bfloat16 and float32 targets): the same weights and math,
  prepacked for oneDNN's kernels, which torch's own linear does not use for a few rows.
- `mkl` (target/packed_mkl.py; float32 targets): the same float32 weights prepacked for MKL's packed
  sgemm, which one-row calls (a one-token step) run through.
- `stream` (target/packed_stream.py; float32 and bfloat16 targets): decoding steps through Headway's
  own kernels (target/csrc/stream_linear.cpp), which stream a one-token step's weights at about the
  memory's rate on every thread and give a row the same bits whatever the other rows or the thread
  count.

What each format needs, and whether it runs here: target/packed_capability.py. The registries
through which compiled graphs find packed weights: target/packed_registry.py. Fused projections:
target/packed_fusion.py. Replacing a model's linears: target/packed_model.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headway.target.packed_float16 import Float16Linear, fp16_linear
from headway.target.packed_mkl import MKLLinear, mkl_linear
from headway.target.packed_onednn import OneDNNLinear, onednn_linear
from headway.target.packed_stream import StreamLinear, stream_bf16, stream_linear

PACKED = {
    "float16": Float16Linear,
    "onednn": OneDNNLinear,
    "mkl": MKLLinear,
    "stream": StreamLinear,
}


def row_linear(module: nn.Module) -> Any:
    """The linear `module` (nn.Linear or a packed format's) as a plain function of rows [n, in]: its
    kernel called directly, without nn.Module dispatch and the reshapes a module does for any input
    (a decoding step makes about a hundred such calls, so per-call overhead shows). Under
    torch.compile, the module itself (which
    it traces)."""
    if isinstance(module, OneDNNLinear):
        packed, bias, pad = module.packed, module.bias, module.pad
        return lambda x: (
            module(x) if torch.compiler.is_compiling() else onednn_linear(x, packed, bias, pad)
        )
    if isinstance(module, Float16Linear):
        packed, scale, prompt = module.packed, module.scale, module.prompt
        return lambda x: (
            module(x) if torch.compiler.is_compiling() else fp16_linear(x, packed, scale, prompt)
        )
    if isinstance(module, MKLLinear):
        packed, weight, bias = module.packed, module.weight.detach(), module.bias
        return lambda x: (
            module(x) if torch.compiler.is_compiling() else mkl_linear(x, packed, weight, bias)
        )
    if isinstance(module, StreamLinear):
        if module.packed is not None:
            args = (
                module.packed,
                module.bias,
                module.out_features,
                module.prompt,
                module.key,
                module._weight(),
            )
            return lambda x: stream_bf16(x, *args)
        weight, bias, onednn = module.weight.detach(), module.bias, module.prompt is not None
        return lambda x: stream_linear(x, weight, bias, onednn)
    if isinstance(module, nn.Linear):
        return lambda x: torch.nn.functional.linear(x, module.weight, module.bias)
    return module
