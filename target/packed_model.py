"""Packing a model's linear weights (model surgery): every nn.Linear of its decoder layers, and its
lm_head, replaced by a format's module (`pack_linear_weights`; a draft head's:
`pack_head_linear_weights`); and what the engines read back from a packed model: its format
(`linear_weights`) and how many rows its steps run (`fewest_rows`, `rows_for_one`).

The lm_head's own weight stays too (the embedding and the EAGLE heads share it); the embedding,
norms and attention run as loaded. The formats: target/packed_formats.py.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from headway.runtime import amx_bf16
from headway.target.packed_capability import check_format
from headway.target.packed_formats import PACKED
from headway.target.packed_fusion import fuse_layer
from headway.target.packed_onednn import ONEDNN_PAD_ROWS


def _swap_linears(module: nn.Module, fmt: str, keep_weight: bool, exact: bool = True) -> int:
    """Every nn.Linear under `module` becomes the packed module of format `fmt`; returns how
    many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PACKED[fmt](child, keep_weight, exact))
            n += 1
        else:
            n += _swap_linears(child, fmt, keep_weight, exact)
    return n


def pack_head_linear_weights(heads: nn.Module, fmt: str = "float16") -> int:
    """A draft head decoding beside a packed target computes its linears the same way (drafts only
    steer speed, never the output): its decoder layers' q/k/v and gate/up as one product each, as
    the target's, and every other linear packed with its weight kept as `.weight`. Inference only:
    never train or save a packed head."""
    layers = getattr(getattr(heads, "decoder", None), "layers", [])
    fused = sum(fuse_layer(layer, fmt, exact=False) for layer in layers)
    return fused + _swap_linears(heads, fmt, keep_weight=True, exact=False)


def fewest_rows(model: Any) -> int:
    """The fewest rows a row-exact (bf16/fp16 CPU) decoding step of this model runs. torch's bf16
    linear over one row takes another kernel than over two or more (which agree with each other, row
    by row), so a one-token step pads to 2 rows to get the bits a tree's row gets; OneDNNLinear pads
    its input itself (ONEDNN_PAD_ROWS), and Float16Linear gives a bf16 row the same bits for any row
    count (chunked on CPUs whose fbgemm kernels
    would not)."""
    return 2 if linear_weights(model) == "native" else 1


# bf16 rows the oneDNN lm_head computes for about the price of its padded ONEDNN_PAD_ROWS on AMX
# CPUs, where the tiles make a row beside the first nearly free and the call streams the weights
# once (the default target's lm_head, 2 threads: 16 rows 1.26 ms, 4 rows 1.17 ms;
# docs/benchmarks.md): a tree step's walk then reads every node's logits from one call. oneDNN's
# bf16 kernels give a row the same bits for any row count of 2 or more.
ONEDNN_AMX_LM_ROWS = 16
# float32 rows the streaming lm_head computes together: 8 cost about 1.8x one (the default target's,
# 2
# threads: 1 row 3.3 ms, 4 rows 5.0, 8 rows 5.9; docs/benchmarks.md), where a greedy walk reads
# about tau rows one by one
STREAM_LM_ROWS = 8


def rows_for_one(model: Any) -> int:
    """How many rows the model's packed lm_head computes for about the price of one: bf16 oneDNN
    pads to ONEDNN_PAD_ROWS anyway, and on AMX runs ONEDNN_AMX_LM_ROWS in about that time (float32
    oneDNN, one); fbgemm's float16 kernel runs 1-3 rows of the default target's lm_head in about the
    time of one; the streaming kernel STREAM_LM_ROWS for less than two; a native weight, one."""
    fmt = linear_weights(model)
    if fmt == "onednn":
        if next(model.parameters()).dtype != torch.bfloat16:
            return 1
        return ONEDNN_AMX_LM_ROWS if amx_bf16() else ONEDNN_PAD_ROWS
    if fmt == "stream":
        return STREAM_LM_ROWS
    return {"float16": 3}.get(fmt, 1)


# the format `pack_linear_weights` packed each model in, keyed weakly by the model (never an
# attribute of it)
_FORMATS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def linear_weights(model: Any) -> str:
    """The format of the model's linear weights: native, float16, onednn or mkl (packed
    by `pack_linear_weights`)."""
    return _FORMATS.get(model, "native")


def pack_linear_weights(model: Any, fmt: str = "float16") -> int:
    """Replace every nn.Linear inside the model's decoder layers, and its lm_head, by the packed
    module of format `fmt` (float16: float32 or bfloat16 CPU targets; onednn: bfloat16 or float32
    CPU targets; mkl: float32 CPU targets); returns how many. On GPUs, load the target
    in bfloat16 or float16 instead."""
    check_format(model, fmt)
    count = sum(fuse_layer(layer, fmt) for layer in model.model.layers)
    count += _swap_linears(model.model.layers, fmt, keep_weight=False)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear):
        model.set_output_embeddings(PACKED[fmt](lm_head, keep_weight=True))
        count += 1
    _FORMATS[model] = fmt
    return count
