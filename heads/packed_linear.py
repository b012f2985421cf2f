"""A CPU inference format for the frozen target: its linear weights packed as float16.

Decoding a small model on a CPU reads every weight once per step, so a step costs what the memory traffic
costs. With `target.linear_weights=float16` every linear layer of the decoder layers, and the lm_head, keeps
its weight packed as float16 (fbgemm, the kernel behind torch's dynamic fp16 quantization) and computes in
float32: half the traffic of float32, and a cost that hardly grows from 1 to ~6 rows, which is what makes
verifying a draft tree cheap. The lm_head's float32 weight stays too (the embedding and the EAGLE heads share
it); the embedding, norms and attention run as loaded. Outputs are exactly this format's own plain decoding;
they can differ from float32's where two tokens nearly tie, as bf16's do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headway.errors import HeadwayError

LINEAR_WEIGHTS = ("native", "float16")


class Float16Linear(nn.Module):
    """nn.Linear's forward over a packed float16 copy of its weight (and bias), float32 in and out."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        """keep_weight: keep the float32 weight as `.weight` too (the lm_head, whose weight the embedding and the
        EAGLE heads share)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self.packed)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=packed float16"


def _swap_linears(module: nn.Module, keep_weight: bool) -> int:
    """Every nn.Linear under `module` becomes a Float16Linear; returns how many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Float16Linear(child, keep_weight))
            n += 1
        else:
            n += _swap_linears(child, keep_weight)
    return n


def pack_head_linear_weights(heads: nn.Module) -> int:
    """A draft head decoding beside a float16-packed target computes its linears the same way (its float32
    weights stay as `.weight`; drafts only steer speed, never the output). Inference only: never train or
    save a packed head."""
    return _swap_linears(heads, keep_weight=True)


def linear_weights(model: Any) -> str:
    """The format of the model's linear weights: native, or float16 (packed by `pack_linear_weights`)."""
    return getattr(model, "headway_linear_weights", "native")


def pack_linear_weights(model: Any) -> int:
    """Replace every nn.Linear inside the model's decoder layers, and its lm_head, by a Float16Linear; returns how
    many. CPU and float32 only (on GPUs, load the target in bfloat16 or float16 instead)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise HeadwayError(f"target.linear_weights=float16 is a CPU format for float32 targets (this one is {p.dtype} "
                           f"on {p.device.type}): set target.dtype=float32 and target.device=cpu, or linear_weights=native")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise HeadwayError(f"target.linear_weights=float16 needs a decoder with `model.layers` ({type(model).__name__} "
                           "has none): use target.linear_weights=native")
    try:
        torch.ops.quantized.linear_prepack_fp16(torch.zeros(1, 1), None)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        raise HeadwayError(f"this torch build has no float16 linear kernels for this CPU ({str(e).splitlines()[0][:120]}): "
                           "use target.linear_weights=native") from None

    count = _swap_linears(layers, keep_weight=False)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear):
        model.set_output_embeddings(Float16Linear(lm_head, keep_weight=True))
        count += 1
    model.headway_linear_weights = "float16"
    return count
