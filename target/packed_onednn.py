"""The `onednn` format (bfloat16 and float32 targets): nn.Linear's forward over a copy of its weight
prepacked for oneDNN's kernels (`OneDNNLinear`, its compiled graphs' op `headway::linear_onednn`);
and the oneDNN call that the float16 and stream formats' bf16 prompts take (`onednn_linear`,
BF16_PROMPT_ROWS).

torch's own linear does not use oneDNN's kernels for a few rows: they give much faster bf16 steps on
AVX512-BF16 CPUs, and float32 one-row steps that use every thread (torch's float32 one-row product
runs on one thread whatever the thread count).
"""

from __future__ import annotations

import torch
from torch import nn

from headway.target.packed_registry import ONEDNN_BY_KEY, register

# bf16 calls of at least this many rows (a prompt's prefill) leave the decoding kernels for a
# oneDNN-packed copy of the bf16 weight where the CPU has oneDNN's bf16 kernels: fbgemm's float16
# kernel computes in float32 and is ~1.8x slower there on an AVX-512 CPU, while its one-row steps
# are ~1.7x faster than oneDNN's; the bf16 streaming kernel reads the weights again for every 4 rows
# (docs/benchmarks.md). The row count alone picks the kernel, and every tree Headway verifies stays
# below it (tune's largest: 64 rows), so plain and speculative decoding make the same calls and keep
# equal tokens.
BF16_PROMPT_ROWS = 128

# OneDNNLinear runs fewer rows as this many (copies of the first row, results dropped): oneDNN's
# prepacked bf16 kernels take another path for one row, and run 1 or 2 rows slower than 4 on
# AVX512-BF16 CPUs. A row's result is then the same bits for any row count.
ONEDNN_PAD_ROWS = 4


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, pad: int
) -> torch.Tensor:
    """x [rows, in] times a prepacked weight, fewer rows than `pad` padded with copies of the
    first."""
    rows = x.shape[0]
    if rows == 1 and pad > 1:
        x = x.expand(pad, -1)
    elif rows < pad:
        x = torch.cat([x, x[:1].expand(pad - rows, -1)])
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")[:rows]


@torch.library.custom_op("headway::linear_onednn", mutates_args=())
def _linear_onednn_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return onednn_linear(x, *ONEDNN_BY_KEY[key])


@_linear_onednn_op.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class OneDNNLinear(nn.Module):
    """nn.Linear's forward, in the weight's dtype (bf16 or float32), over a copy of its weight
    prepacked for oneDNN's kernels."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep the weight as `.weight` too (see Float16Linear). exact: always (the
        bf16 weight as is)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the batch-size hint only picks the packed layout; 1..16 rows measured the same with any
        # hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        # bf16 pads few rows (row-exact decoding, and faster); float32 runs one row as one (padding
        # it to 4 rows made the default target's float32 step 1.4x slower), and its decoding is not
        # row-exact in any format
        self.pad = ONEDNN_PAD_ROWS if linear.weight.dtype == torch.bfloat16 else 1
        self.key = register(ONEDNN_BY_KEY, (self.packed, self.bias, self.pad), self)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_onednn(x2, self.key, self.out_features)
        else:
            y = onednn_linear(x2, self.packed, self.bias, self.pad)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, "
            f"out_features={self.out_features}, weights=bf16 packed for oneDNN"
        )
