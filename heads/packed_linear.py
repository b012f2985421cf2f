"""CPU inference formats for the frozen target's linear weights (decoder layers and lm_head).

Decoding a small model on a CPU reads every weight once per step, so a step costs what the memory traffic
and the kernels cost. Two formats replace every nn.Linear by a module over a prepacked weight:

- `float16` (float32 targets): the weight packed as float16 (fbgemm, the kernel behind torch's dynamic fp16
  quantization), float32 compute: half the traffic of float32, a cost that hardly grows from 1 to ~6 rows
  (what makes verifying a draft tree cheap), and a row's result that does not depend on the row count. Outputs
  are exactly this format's own plain decoding; they can differ from float32's where two tokens nearly tie.
- `onednn` (bfloat16 targets): the same bf16 weights and math, prepacked for oneDNN's bf16 kernels, which
  torch's own bf16 linear does not use for a few rows (1.3x a bf16 step on an AVX512-BF16 CPU).

The lm_head's own weight stays too (the embedding and the EAGLE heads share it); the embedding, norms and
attention run as loaded.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from headway.errors import HeadwayError

LINEAR_WEIGHTS = ("native", "float16", "onednn")

# torch.compile cannot trace a packed fbgemm weight (a TorchScript object): every Float16Linear would break the graph
# in two. Under compile the layer calls an opaque custom op instead, which finds its packed weight by a number.
_PACKED_FP16: dict[int, object] = {}
_KEYS = itertools.count()


@torch.library.custom_op("headway::linear_fp16", mutates_args=())
def _linear_fp16(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, _PACKED_FP16[key])


@_linear_fp16.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Float16Linear(nn.Module):
    """nn.Linear's forward over a packed float16 copy of its weight (and bias), float32 in and out."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        """keep_weight: keep the float32 weight as `.weight` too (the lm_head, whose weight the embedding and the
        EAGLE heads share)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.key = next(_KEYS)
        _PACKED_FP16[self.key] = self.packed
        weakref.finalize(self, _PACKED_FP16.pop, self.key, None)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_fp16(x2, self.key, self.out_features)
        else:  # eager: the op itself (a custom op's dispatch adds ~5 us a call, 211 calls a step)
            y = torch.ops.quantized.linear_dynamic_fp16(x2, self.packed)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=packed float16"


class OneDNNLinear(nn.Module):
    """nn.Linear's forward, bf16 in and out, over a copy of its bf16 weight prepacked for oneDNN's kernels."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        """keep_weight: keep the weight as `.weight` too (see Float16Linear)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the batch-size hint only picks the packed layout; 1..16 rows measured the same with any hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 packed for oneDNN"


PACKED = {"float16": Float16Linear, "onednn": OneDNNLinear}


def _swap_linears(module: nn.Module, fmt: str, keep_weight: bool) -> int:
    """Every nn.Linear under `module` becomes the packed module of format `fmt`; returns how many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PACKED[fmt](child, keep_weight))
            n += 1
        else:
            n += _swap_linears(child, fmt, keep_weight)
    return n


def pack_head_linear_weights(heads: nn.Module, fmt: str = "float16") -> int:
    """A draft head decoding beside a packed target computes its linears the same way (its weights stay as
    `.weight`; drafts only steer speed, never the output). Inference only: never train or save a packed head."""
    return _swap_linears(heads, fmt, keep_weight=True)


def linear_weights(model: Any) -> str:
    """The format of the model's linear weights: native, float16 or onednn (packed by `pack_linear_weights`)."""
    return getattr(model, "headway_linear_weights", "native")


def _check_format(model: Any, fmt: str) -> None:
    """One message for a target the format cannot serve."""
    p = next(model.parameters())
    want = {"float16": torch.float32, "onednn": torch.bfloat16}[fmt]
    name = str(want).removeprefix("torch.")
    if p.device.type != "cpu" or p.dtype != want:
        raise HeadwayError(f"target.linear_weights={fmt} is a CPU format for {name} targets (this one is {p.dtype} "
                           f"on {p.device.type}): set target.dtype={name} and target.device=cpu, or linear_weights=native")
    if getattr(getattr(model, "model", None), "layers", None) is None:
        raise HeadwayError(f"target.linear_weights={fmt} needs a decoder with `model.layers` ({type(model).__name__} "
                           "has none): use target.linear_weights=native")
    reason = _kernels_missing(fmt)
    if reason:
        raise HeadwayError(f"this torch build has no {fmt} linear kernels for this CPU ({reason}): "
                           "use target.linear_weights=native")


def _kernels_missing(fmt: str) -> str | None:
    """Why this torch build or CPU cannot run the format's kernels; None when it can."""
    if fmt == "onednn":
        ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return None if ok else "oneDNN has no bf16 kernels for this CPU"
    try:
        torch.ops.quantized.linear_prepack_fp16(torch.zeros(1, 1), None)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # a build without fbgemm
        return str(e).splitlines()[0][:120]
    return None


def pack_linear_weights(model: Any, fmt: str = "float16") -> int:
    """Replace every nn.Linear inside the model's decoder layers, and its lm_head, by the packed module of format
    `fmt` (float16: float32 CPU targets; onednn: bfloat16 CPU targets); returns how many. On GPUs, load the target
    in bfloat16 or float16 instead."""
    _check_format(model, fmt)
    count = _swap_linears(model.model.layers, fmt, keep_weight=False)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear):
        model.set_output_embeddings(PACKED[fmt](lm_head, keep_weight=True))
        count += 1
    model.headway_linear_weights = fmt
    return count
