"""The `mkl` format (float32 targets): the float32 weights prepacked for MKL's packed sgemm
(`MKLLinear`, its compiled graphs' op `headway::linear_mkl`).

One-row calls (a one-token step) run through the packed sgemm, which streams the weights closer to
the memory's rate than torch's or oneDNN's float32 kernels. Calls of other row counts (trees,
prompts) take torch's float32 linear over the weights as loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from headway.target.packed_registry import MKL_BY_KEY, register

# MKL's packed sgemm serves the row count the weight was packed for: one row, a one-token step
MKL_PACKED_ROWS = 1


def mkl_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] (float32) times a weight packed for MKL: one row through the packed sgemm, any
    other row count through torch's linear over `weight` (the op's own fallback)."""
    return torch.ops.mkl._mkl_linear.default(x, packed, weight, bias, MKL_PACKED_ROWS)


@torch.library.custom_op("headway::linear_mkl", mutates_args=())
def _linear_mkl_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return mkl_linear(x, *MKL_BY_KEY[key])


@_linear_mkl_op.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class MKLLinear(nn.Module):
    """nn.Linear's forward for a float32 weight, one-row calls through a copy of the weight packed
    for MKL's sgemm (the weight as loaded stays, for other row counts)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: always (the other row counts read it). exact: always (the float32 weight as
        is)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(
            linear.weight.detach(), MKL_PACKED_ROWS
        )
        self.key = register(MKL_BY_KEY, (self.packed, self.weight.detach(), self.bias), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_mkl(x2, self.key, self.out_features)
        else:
            y = mkl_linear(x2, self.packed, self.weight.detach(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, "
            f"out_features={self.out_features}, weights=float32 packed for MKL"
        )
