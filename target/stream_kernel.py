"""Headway's streaming linears (csrc/stream_linear.cpp), built on first use with torch's extension
builder.

It registers `torch.ops.headway_kernels.stream_linear` (float32) and `stream_linear_bf16` (bf16 rows
over a weight packed by `stream_pack_bf16`), which `StreamLinear` (target.linear_weights=stream) and
the static engine's C++ layer loop call. Building needs a C++ compiler once (cached under
TORCH_EXTENSIONS_DIR); where there is none, or the CPU lacks the instructions (AVX-512, or AVX2 with
FMA), the format is refused with the reason. bf16 rows run on `vdpbf16ps` where the CPU has
AVX512-BF16, else in float32 fused multiply-adds on AVX2 (`bf16_build`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

import torch

from headway.target.build import load_extension

log = logging.getLogger("headway")

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "stream_linear.cpp")
# -ffp-contract=off for everything but the kernel's own functions, which contract to fused
# multiply-adds in every build alike (their optimize attribute)
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# [(module, "")] once built, [(None, why)] once a build failed
_BUILT: list[tuple[Optional[Any], str]] = []
# held while building: a caller waits for a build started in the background
_LOCK = threading.Lock()


def _bf16_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out)


def _build() -> tuple[Optional[Any], str]:
    if _BUILT:  # (no lock once built)
        return _BUILT[0]
    with _LOCK:
        return _build_locked()


def _build_locked() -> tuple[Optional[Any], str]:
    if not _BUILT:
        try:
            built = load_extension(
                "headway_stream_linear",
                [SOURCE],
                CFLAGS,
                announce="building Headway's streaming linear (once; cached by torch's extension builder)",
            )
            _BUILT.append((built, ""))
            # the bf16 op's output shape, for torch.compile (which traces the compiled engine's
            # steps through it)
            torch.library.register_fake("headway_kernels::stream_linear_bf16")(_bf16_shape)
        except Exception as e:  # no compiler, no headers
            lines = str(e).strip().splitlines()
            _BUILT.append(
                (None, f"it did not build here ({lines[-1] if lines else type(e).__name__})")
            )
    return _BUILT[0]


def build_in_background() -> None:
    """Start building the extension on a thread (once cached, that only loads it), so that its
    compile overlaps whatever the caller does next (fetching and loading the target); the first use
    waits for it."""
    if not _BUILT:
        threading.Thread(target=_build, name="headway-build-stream-linear").start()


def stream_kernel() -> Any:
    """The built extension (its `stream_linear_isa` runs one build, for tests); raises RuntimeError
    where `unavailable` gives a reason."""
    why = unavailable()
    if why:
        raise RuntimeError(f"the streaming linear cannot run: {why}")
    return _build()[0]


def unavailable() -> Optional[str]:
    """Why the streaming linear cannot run on this machine; None where it can (building it on the
    first call)."""
    module, why = _build()
    if module is None:
        return why
    if not module.available():
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    return None


def bf16_unavailable() -> Optional[str]:
    """Why the streaming linear cannot run bf16 rows here; None where it can (building it on the
    first call)."""
    module, why = _build()
    if module is None:
        return why
    if not module.bf16_available():
        return "its bf16 kernel needs a CPU with AVX512-BF16, or AVX2 with FMA"
    return None


def bf16_build() -> str:
    """The bf16 build this CPU runs: "avx512bf16" (vdpbf16ps), "avx2" (float32 fused multiply-adds)
    or "" (none, or the kernel did not build)."""
    module, _ = _build()
    return "" if module is None else module.bf16_build()
