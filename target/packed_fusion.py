"""Fused projections: in Llama-style layers the query, key and value projections are packed as one
weight, and the MLP's gate and up projections as another (`FusedLinear`): a step then makes 4 calls
a layer instead of 7, over larger weights. The model's own forward still calls one module per
original linear (`FusedPart`); Headway's static engine calls the fused module itself
(`fused_projections`).
"""

from __future__ import annotations

import torch
from torch import nn

from headway.target.packed_formats import PACKED


class FusedLinear(nn.Module):
    """Several linears over the same input as one packed weight (their rows stacked): returns their
    outputs, views of one result. Headway's static engine calls it (`fused_projections`); the
    model's own forward calls the `FusedPart`s that replace the original linears, each of which
    computes the whole product and keeps its part."""

    def __init__(self, linears: list[nn.Linear], fmt: str, exact: bool = True):
        """exact: as the packed format's (False for a draft head's weights, which may round)."""
        super().__init__()
        biases = [lin.bias for lin in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            biases = [
                torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                if lin.bias is None
                else lin.bias
                for lin in linears
            ]
        stacked = nn.Linear(
            linears[0].in_features,
            sum(lin.out_features for lin in linears),
            bias=biases[0] is not None,
            dtype=linears[0].weight.dtype,
        )
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([lin.weight.detach() for lin in linears]))
            if stacked.bias is not None:
                stacked.bias.copy_(torch.cat([b.detach() for b in biases]))
        self.linear = PACKED[fmt](stacked, exact=exact)
        self.sizes = [lin.out_features for lin in linears]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


class FusedPart(nn.Module):
    """One of a FusedLinear's linears, for the model's own forward (the HF engine): the whole
    product, then its part."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.fused = [fused]  # a list: not a second registration of the fused module's state
        self.index = index
        self.in_features, self.out_features = fused.linear.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0](x)[self.index]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"part {self.index} of a fused weight"
        )


_FUSED_GROUPS = (
    ("self_attn", "headway_qkv", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "headway_gate_up", ("gate_proj", "up_proj")),
)


def fuse_layer(layer: nn.Module, fmt: str, exact: bool = True) -> int:
    """Pack a Llama-style layer's q/k/v projections as one weight and its gate/up projections as
    another, where the layer has them as nn.Linear; returns how many linears were packed. exact: as
    FusedLinear's."""
    n = 0
    for owner_name, fused_name, names in _FUSED_GROUPS:
        owner = getattr(layer, owner_name, None)
        linears = [getattr(owner, name, None) for name in names]
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            continue
        fused = FusedLinear(linears, fmt, exact)
        setattr(owner, fused_name, fused)
        for i, name in enumerate(names):
            setattr(owner, name, FusedPart(fused, i))
        n += len(names)
    return n


def fused_projections(module: nn.Module, name: str) -> FusedLinear | None:
    """The FusedLinear `pack_linear_weights` made for `module` (an attention or MLP), or None."""
    return getattr(module, name, None)
