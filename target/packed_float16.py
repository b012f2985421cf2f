"""The `float16` format (float32 and bfloat16 targets): nn.Linear's forward over a copy of its
weight packed as float16 for fbgemm, the kernel behind torch's dynamic fp16 quantization
(`Float16Linear`, its compiled graphs' op `headway::linear_fp16`).

float32 accumulation, and a row's result that does not depend on the row count. For float32 targets
the weights are rounded to float16 (half the traffic; outputs are exactly this format's own plain
decoding, which can differ from float32's where two tokens nearly tie). For bfloat16 targets it is
exact: a bf16 weight is a float16 value (a power-of-two scale brings tiny ones into range; a matrix
    no scale fits is refused), bf16
inputs convert exactly to float32, and the output rounds to bf16: bf16 math, through fbgemm's fast
one-row kernel (faster than oneDNN's for one-token steps; verifying 8 or more rows costs more than
with oneDNN, and bf16 prompts take a oneDNN copy where the CPU has oneDNN's bf16 kernels).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from headway.errors import HeadwayError
from headway.target.packed_capability import kernels_missing
from headway.target.packed_fbgemm import (
    FBGEMM_CHUNKED_ROWS,
    fbgemm_chunked,
    fbgemm_fp16,
    fbgemm_rows_vary,
)
from headway.target.packed_onednn import BF16_PROMPT_ROWS, onednn_linear
from headway.target.packed_registry import FP16_BY_KEY, register


def fp16_linear(
    x: torch.Tensor, packed: object, scale: float, prompt: Optional[tuple] = None
) -> torch.Tensor:
    """x [rows, in] times a weight packed as float16 (fbgemm), in float32; a bf16 x is converted in
    and out (exactly in: bf16 values are float32 values), in row-count-independent chunks where this
    CPU's kernels need them. `scale`: the power of two the packed weight was multiplied by.
    `prompt`: (oneDNN-packed bf16 weight, bias) for bf16 calls of BF16_PROMPT_ROWS rows or more."""
    if x.dtype == torch.float32:
        return fbgemm_fp16(x, packed)
    if prompt is not None and x.shape[0] >= BF16_PROMPT_ROWS:
        return onednn_linear(x, prompt[0], prompt[1], 1)
    xf = x.float()
    if x.shape[0] <= FBGEMM_CHUNKED_ROWS and fbgemm_rows_vary():
        y = fbgemm_chunked(xf, packed)
    else:
        y = fbgemm_fp16(xf, packed)
    return (y if scale == 1.0 else y.mul_(scale)).to(x.dtype)


@torch.library.custom_op("headway::linear_fp16", mutates_args=())
def _linear_fp16(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return fp16_linear(x, *FP16_BY_KEY[key])


@_linear_fp16.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _float16_exact(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """A bf16 weight (and bias) as float32 values that float16 holds exactly, times a power of two
    where that brings small weights into float16's normal range; and the inverse scale. float16 has
    3 more mantissa bits than bf16 and 3 fewer exponent bits: a bf16 value is a float16 value when
    its exponent fits. Raises where no scale
    fits all."""
    w = weight.detach().float()
    b = None if bias is None else bias.detach().float()
    top = float(w.abs().max()) if w.numel() else 0.0
    for k in (0, max(0, min(24, int(math.floor(math.log2(65504.0 / top)))) if top > 0 else 0)):
        ws, bs = w * 2.0**k, None if b is None else b * 2.0**k
        if all(t is None or bool((t.half().float() == t).all()) for t in (ws, bs)):
            return ws, bs, 2.0**-k
    lost = int((ws.half().float() != ws).sum())
    raise HeadwayError(
        f"target.linear_weights=float16: {lost} of {w.numel()} bf16 weights of a {tuple(w.shape)} "
        "linear do not fit float16 at any one scale, so the format would change this bf16 target's "
        "outputs: use target.linear_weights=onednn"
    )


class Float16Linear(nn.Module):
    """nn.Linear's forward over a copy of its weight packed as float16 for fbgemm, float32
    accumulation. For a float32 target the weight is rounded to float16; for a bf16 target it is
    exact (bf16 inputs converted exactly to float32, outputs rounded to bf16: a bf16 linear whose
    one-row steps are fbgemm's fast path)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep the weight as `.weight` too (the lm_head, whose weight the embedding
        and the EAGLE heads share). exact: refuse a bf16 weight that float16 cannot hold (a
        target's; a draft head's may round)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias, self.scale = linear.weight.detach().float(), linear.bias, 1.0
        bias = None if bias is None else bias.detach().float()
        if linear.weight.dtype == torch.bfloat16 and exact:
            weight, bias, self.scale = _float16_exact(linear.weight, linear.bias)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        # bf16 prompts' rows: the bf16 weight prepacked for oneDNN too, where it has bf16
        # kernels (BF16_PROMPT_ROWS)
        self.prompt: Optional[tuple] = None
        if linear.weight.dtype == torch.bfloat16 and not kernels_missing("onednn", torch.bfloat16):
            self.prompt = (
                torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                None if linear.bias is None else linear.bias.detach(),
            )
        self.key = register(FP16_BY_KEY, (self.packed, self.scale, self.prompt), self)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_fp16(x2, self.key, self.out_features)
        else:
            # eager: the op itself (a custom op's dispatch costs a little on every call, and a step
            # makes hundreds)
            y = fp16_linear(x2, self.packed, self.scale, self.prompt)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=packed float16"
