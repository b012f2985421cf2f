"""The `stream` format (float32 and bfloat16 targets): decoding steps through Headway's own kernels
(target/csrc/stream_linear.cpp, built by target/stream_kernel.py), which stream a one-token step's
weights at about the memory's rate on every thread and give a row the same bits whatever the other
rows or the thread count (`StreamLinear`).

float32: the weights as loaded, calls of up to STREAM_MAX_ROWS rows, AVX-512 or AVX2 builds alike.
    bfloat16: a
copy packed for its kernel, bf16 products summed in float32 by `vdpbf16ps` on AVX512-BF16 CPUs (a
tree's rows cost little beside the first: the fastest bf16 format there without AMX), or in the same
order by float32 fused multiply-adds on AVX2 ones, calls of fewer than BF16_PROMPT_ROWS rows.
Prompts take oneDNN's linear over the float32 weights as loaded (torch's linear where torch has no
oneDNN), and a oneDNN-packed copy of the bf16 ones (where oneDNN has no bf16 kernels, torch's
float32 linear over a float32 copy made for the call). The kernels are ops of their own extension
(`torch.ops.headway_kernels`); a compiled graph's bf16 prompt calls `headway::linear_onednn`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from headway.target.packed_capability import kernels_missing
from headway.target.packed_onednn import BF16_PROMPT_ROWS, onednn_linear
from headway.target.packed_registry import ONEDNN_BY_KEY, register

# StreamLinear's kernel takes calls of up to this many rows (decoding steps: one token, a tree);
# more (a prompt) read the weight better in cache blocks, through oneDNN's linear (its float32
# kernels prefilled a 1,000-token prompt 1.2x faster than torch's, MKL's, on the AVX512-BF16 EPYC at
# 1 thread, alike at 2; docs/benchmarks.md)
STREAM_MAX_ROWS = 32


class StreamLinear(nn.Module):
    """nn.Linear's forward for a float32 or bf16 weight, decoding steps through Headway's streaming
    kernels.
    float32: the weight as loaded, calls of up to STREAM_MAX_ROWS rows
    (`torch.ops.headway_kernels.stream_linear`), prompts through oneDNN's linear over that weight
    (torch's where torch has no oneDNN). bf16: a copy packed for the bf16 kernel, calls of fewer
    than BF16_PROMPT_ROWS rows (`stream_linear_bf16`), every row's bits independent of the row
    count; prompts on a oneDNN-packed copy where the CPU has oneDNN's bf16 kernels (the weight as
    loaded is then dropped unless kept), else in float32 (`_float32_prompt`)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep a bf16 weight as `.weight` beside its oneDNN copy (the lm_head, whose
        weight the embedding and the EAGLE heads share); float32, or bf16 without oneDNN: always
        (prompts read it).
        exact: always (both kernels compute in the weight's dtype)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # bf16: [out / 4, in / 32, 4, 32], the kernel's layout
        self.packed: Optional[torch.Tensor] = None
        # prompts' rows through oneDNN: bf16, (the weight prepacked for it, bias); float32, (the
        # weight as loaded, bias)
        self.prompt: Optional[tuple] = None
        self.key = -1  # the prompt copy's in ONEDNN_BY_KEY, for compiled graphs
        if linear.weight.dtype == torch.bfloat16:
            self.packed = torch.ops.headway_kernels.stream_pack_bf16(linear.weight.detach())
            if not kernels_missing("onednn", torch.bfloat16):
                self.prompt = (
                    torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                    self.bias,
                )
                self.key = register(ONEDNN_BY_KEY, (*self.prompt, 1), self)
        elif linear.weight.dtype == torch.float32 and not kernels_missing("onednn", torch.float32):
            self.prompt = (linear.weight.detach(), self.bias)
        if keep_weight or self.prompt is None or self.packed is None:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None:
            y = stream_bf16(
                x2, self.packed, self.bias, self.out_features, self.prompt, self.key, self._weight()
            )
        else:
            y = stream_linear(x2, self.weight.detach(), self.bias, self.prompt is not None)
        return y.view(*x.shape[:-1], self.out_features)

    def _weight(self) -> Optional[torch.Tensor]:
        weight = getattr(self, "weight", None)
        return None if weight is None else weight.detach()

    def extra_repr(self) -> str:
        kind = "float32 streamed" if self.packed is None else "bf16 packed for the streaming kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={kind}"


def stream_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False
) -> torch.Tensor:
    """x [rows, in] times a float32 `weight` [out, in]: a decoding step's float32 rows through the
    streaming kernel; a prompt's through oneDNN's linear over the same weight (`onednn`) or torch's;
    another dtype's (a float64 head beside the target) or a traced graph's (which cannot call the
    kernel) through torch's linear."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if x.shape[0] > STREAM_MAX_ROWS:
        if onednn and not torch.compiler.is_compiling():
            return onednn_linear(x, weight, bias, 1)
        return torch.nn.functional.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.headway_kernels.stream_linear(x, weight, bias)


def stream_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    prompt: Optional[tuple],
    key: int,
    weight: Optional[torch.Tensor],
) -> torch.Tensor:
    """x [rows, in] bf16 times a weight packed for the bf16 streaming kernel: fewer than
    BF16_PROMPT_ROWS rows through it (in a compiled graph too: row-exact decoding needs its bits), a
    prompt's on the oneDNN copy `prompt` (key: its registry entry, for compiled graphs), or where
    there is none in float32 over `weight` (`_float32_prompt`)."""
    if x.shape[0] < BF16_PROMPT_ROWS:
        return torch.ops.headway_kernels.stream_linear_bf16(x, packed, bias, out_features)
    if prompt is None:
        return _float32_prompt(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.headway.linear_onednn(x, key, out_features)
    return onednn_linear(x, prompt[0], prompt[1], 1)


def _float32_prompt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A bf16 prompt's rows [rows, in] times a bf16 weight [out, in] where oneDNN has no bf16
    kernels (AVX2 CPUs): in float32 over a float32 copy of the weight made for the call (bf16
        products are exact in
    float32), rounded once to bf16. torch's bf16 linear emulates bf16 on such CPUs, ~4x slower than
    its float32 one (MKL's sgemm); the copy costs a small part of that. The C++ layer loop computes
    the same (`stream`
    in inference/engines/static/csrc/layer_loop.cpp)."""
    return torch.nn.functional.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    ).bfloat16()
