"""What can run a packed format here: `kernels_missing` says why this torch build or CPU lacks a
format's kernels for a dtype (the formats' modules ask it before making a oneDNN copy, the demo
before choosing a format), and `check_format` gives one message for a target a format cannot serve,
before `pack_linear_weights` packs anything.

Apart from the formats' modules because they ask it too (whether to make a bf16 weight's oneDNN
prompt copy), as the model surgery (target/packed_model.py) does before packing.
"""

from __future__ import annotations

from typing import Any

import torch

from headway.errors import HeadwayError
from headway.target.packed_fbgemm import fbgemm_probe
from headway.target.stream_kernel import bf16_unavailable as stream_bf16_unavailable
from headway.target.stream_kernel import unavailable as stream_unavailable


def check_format(model: Any, fmt: str) -> None:
    """One message for a target the format cannot serve."""
    p = next(model.parameters())
    want = {
        "float16": (torch.float32, torch.bfloat16),
        "onednn": (torch.bfloat16, torch.float32),
        "mkl": (torch.float32,),
        "stream": (torch.float32, torch.bfloat16),
    }[fmt]
    names = " or ".join(str(d).removeprefix("torch.") for d in want)
    if p.device.type != "cpu" or p.dtype not in want:
        raise HeadwayError(
            f"target.linear_weights={fmt} is a CPU format for {names} targets (this one is {p.dtype} "
            f"on {p.device.type}): set target.dtype={str(want[0]).removeprefix('torch.')} and "
            "target.device=cpu, or linear_weights=native"
        )
    if getattr(getattr(model, "model", None), "layers", None) is None:
        raise HeadwayError(
            f"target.linear_weights={fmt} needs a decoder with `model.layers` ({type(model).__name__} "
            "has none): use target.linear_weights=native"
        )
    reason = kernels_missing(fmt, p.dtype)
    if reason:
        raise HeadwayError(
            f"target.linear_weights={fmt}: no kernels for it "
            f"here ({reason}): use target.linear_weights=native"
        )
    if fmt == "float16" and p.dtype == torch.bfloat16 and not fbgemm_probe()[1]:
        raise HeadwayError(
            "target.linear_weights=float16 with a bfloat16 target: this CPU's fbgemm float16 kernels give "
            "a row bits that depend on how many rows a call has, so speculative decoding would not equal "
            "plain decoding: use target.linear_weights=native, or target.dtype=float32 with float16 weights"
        )


def kernels_missing(fmt: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why this torch build or CPU cannot run the format's kernels for a target of `dtype`; None
    when it can."""
    if fmt == "onednn":
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN"
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "oneDNN has no bf16 kernels for this CPU"
        return None
    if fmt == "stream":
        return stream_bf16_unavailable() if dtype == torch.bfloat16 else stream_unavailable()
    if fmt == "mkl":
        if not torch.backends.mkl.is_available() or not torch.backends.mkldnn.is_available():
            return "this torch build has no MKL (or no oneDNN, whose tensors hold MKL's packed weights)"
        return None
    try:
        torch.ops.quantized.linear_prepack_fp16(torch.zeros(1, 1), None)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # a build without fbgemm
        return str(e).splitlines()[0][:120]
    return None
