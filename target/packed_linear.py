"""CPU inference formats for the frozen target's linear weights (decoder layers and lm_head).

Decoding a small model on a CPU reads every weight once per step, so a step costs what the memory traffic
and the kernels cost. Three formats replace every nn.Linear by a module over a prepacked weight:

- `float16`: the weight packed as float16 (fbgemm, the kernel behind torch's dynamic fp16 quantization), float32
  accumulation, a row's result that does not depend on the row count. For float32 targets the weights are rounded
  to float16 (half the traffic; outputs are exactly this format's own plain decoding, which can differ from
  float32's where two tokens nearly tie). For bfloat16 targets it is exact: a bf16 weight is a float16 value (a
  power-of-two scale brings tiny ones into range; a matrix no scale fits is refused), bf16 inputs convert exactly
  to float32, and the output rounds to bf16: bf16 math, through fbgemm's fast one-row kernel (faster than oneDNN's
  for one-token steps; verifying 8 or more rows costs more than with oneDNN).
- `onednn` (bfloat16 and float32 targets): the same weights and math, prepacked for oneDNN's kernels, which torch's
  own linear does not use for a few rows: much faster bf16 steps on AVX512-BF16 CPUs, and float32 one-row steps that
  use every thread (torch's float32 one-row product runs on one thread whatever the thread count).
- `mkl` (float32 targets): the same float32 weights prepacked for MKL's packed sgemm, which one-row calls (a
  one-token step) run through: it streams the weights closer to the memory's rate than torch's or oneDNN's float32
  kernels. Calls of other row counts (trees, prompts) take torch's float32 linear over the weights as loaded.
- `stream` (float32 and bfloat16 targets): decoding steps through Headway's own kernels (target/csrc/stream_linear.cpp),
  which stream a one-token step's weights at about the memory's rate on every thread and give a row the same bits
  whatever the other rows or the thread count. float32: the weights as loaded, calls of up to STREAM_MAX_ROWS rows,
  AVX-512 or AVX2 builds alike. bfloat16: a copy packed for its kernel, bf16 products summed in float32 by
  `vdpbf16ps` on AVX512-BF16 CPUs (a tree's rows cost little beside the first: the fastest bf16 format there without
  AMX), or in the same order by float32 fused multiply-adds on AVX2 ones, calls of fewer than BF16_PROMPT_ROWS rows.
  Prompts take oneDNN's linear over the float32 weights as loaded (torch's linear where torch has no oneDNN), and a
  oneDNN-packed copy of the bf16 ones (where oneDNN has no bf16 kernels, torch's float32 linear over a float32 copy
  made for the call).

The lm_head's own weight stays too (the embedding and the EAGLE heads share it); the embedding, norms and
attention run as loaded. In Llama-style layers the query, key and value projections are packed as one weight, and the
MLP's gate and up projections as another (`FusedLinear`): a step then makes 4 calls a layer instead of 7, over larger
weights.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from typing import Any, Optional

import torch
from torch import nn

from headway.errors import HeadwayError
from headway.runtime import amx_bf16
from headway.target.stream_kernel import bf16_unavailable as stream_bf16_unavailable
from headway.target.stream_kernel import unavailable as stream_unavailable

# torch.compile cannot trace a packed fbgemm weight (a TorchScript object): every Float16Linear would break the graph
# in two, and inductor cannot lower oneDNN's prepacked op. Under compile each layer calls an opaque custom op instead,
# which finds its packed weight by a number.
_PACKED_FP16: dict[int, object] = {}
_PACKED_ONEDNN: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
_PACKED_MKL: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
_KEYS = itertools.count()


def _register(registry: dict, value: Any, owner: Any) -> int:
    """A key for `value` in `registry`, dropped when `owner` is collected."""
    key = next(_KEYS)
    registry[key] = value
    weakref.finalize(owner, registry.pop, key, None)
    return key


# fbgemm's float16 kernels on AVX2 CPUs (not on AVX512 ones) accumulate a block of 1 or 2 rows in another order than
# a block of 3 to 6, and a call picks its blocks from its row count: a row's bits then depend on how many rows the
# call has, and a verified tree's rows differ from the one-row steps of plain decoding. Row-exact (bf16) calls of up
# to this many rows then go in chunks of 3 to 6 rows (a step of 1 or 2 rows padded with copies of its first), whose
# rows agree with each other; longer inputs (a prompt's prefill, the same call in plain and speculative decoding) go
# in one call. fbgemm's thread count never changes a row's bits.
FBGEMM_CHUNKED_ROWS = 512
FBGEMM_CHUNK = (3, 6)  # the fewest and most rows of a chunk


def _fbgemm_fp16(x: torch.Tensor, packed: object) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16.default(x, packed)


def _fbgemm_chunked(x: torch.Tensor, packed: object) -> torch.Tensor:
    """x [rows, in] (float32) through fbgemm in chunks of FBGEMM_CHUNK rows: every row's bits the same for any row
    count, on every CPU."""
    rows, (least, most) = x.shape[0], FBGEMM_CHUNK
    if rows < least:
        return _fbgemm_fp16(torch.cat([x, x[:1].expand(least - rows, -1)]), packed)[:rows]
    if rows <= most:
        return _fbgemm_fp16(x, packed)
    chunks = -(-rows // most)  # as even as possible: each has rows // chunks >= least rows
    sizes = [rows // chunks + (i < rows % chunks) for i in range(chunks)]
    return torch.cat([_fbgemm_fp16(part, packed) for part in x.split(sizes)])


@functools.cache
def _fbgemm_probe() -> tuple[bool, bool]:
    """Probed once on a small random weight: whether fbgemm's float16 kernel gives a row other bits in calls of other
    row counts on this CPU (AVX2: yes), and whether `_fbgemm_chunked` gives it the same bits for every count."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 512, generator=gen) / 16).half().float()
    x = torch.randn(16, 512, generator=gen)
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)

    def agree(call: Any) -> bool:
        alone = torch.cat([call(x[i : i + 1], packed) for i in range(16)])
        return all(torch.equal(call(x[:n], packed), alone[:n]) for n in range(2, 17))

    return not agree(_fbgemm_fp16), agree(_fbgemm_chunked)


def fbgemm_rows_vary() -> bool:
    """Whether this CPU's fbgemm float16 kernels give a row bits that depend on the call's row count (AVX2: yes);
    Float16Linear then chunks row-exact calls (`_fbgemm_chunked`)."""
    return _fbgemm_probe()[0]


# bf16 calls of at least this many rows (a prompt's prefill) leave the decoding kernels for a oneDNN-packed copy of the
# bf16 weight where the CPU has oneDNN's bf16 kernels: fbgemm's float16 kernel computes in float32 and is ~1.8x slower
# there on an AVX-512 CPU, while its one-row steps are ~1.7x faster than oneDNN's; the bf16 streaming kernel reads the
# weights again for every 4 rows (docs/benchmarks.md). The row count alone picks the kernel, and every tree Headway
# verifies stays below it (tune's largest: 64 rows), so plain and speculative decoding make the same calls and keep
# equal tokens.
BF16_PROMPT_ROWS = 128


def _fp16_linear(
    x: torch.Tensor, packed: object, scale: float, prompt: Optional[tuple] = None
) -> torch.Tensor:
    """x [rows, in] times a weight packed as float16 (fbgemm), in float32; a bf16 x is converted in and out (exactly
    in: bf16 values are float32 values), in row-count-independent chunks where this CPU's kernels need them.
    `scale`: the power of two the packed weight was multiplied by. `prompt`: (oneDNN-packed bf16 weight, bias) for
    bf16 calls of BF16_PROMPT_ROWS rows or more."""
    if x.dtype == torch.float32:
        return _fbgemm_fp16(x, packed)
    if prompt is not None and x.shape[0] >= BF16_PROMPT_ROWS:
        return _onednn_linear(x, prompt[0], prompt[1], 1)
    xf = x.float()
    if x.shape[0] <= FBGEMM_CHUNKED_ROWS and fbgemm_rows_vary():
        y = _fbgemm_chunked(xf, packed)
    else:
        y = _fbgemm_fp16(xf, packed)
    return (y if scale == 1.0 else y.mul_(scale)).to(x.dtype)


@torch.library.custom_op("headway::linear_fp16", mutates_args=())
def _linear_fp16(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return _fp16_linear(x, *_PACKED_FP16[key])


@_linear_fp16.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _float16_exact(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """A bf16 weight (and bias) as float32 values that float16 holds exactly, times a power of two where that brings
    small weights into float16's normal range; and the inverse scale. float16 has 3 more mantissa bits than bf16 and
    3 fewer exponent bits: a bf16 value is a float16 value when its exponent fits. Raises where no scale fits all."""
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
    """nn.Linear's forward over a copy of its weight packed as float16 for fbgemm, float32 accumulation. For a
    float32 target the weight is rounded to float16; for a bf16 target it is exact (bf16 inputs converted exactly to
    float32, outputs rounded to bf16: a bf16 linear whose one-row steps are fbgemm's fast path)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep the weight as `.weight` too (the lm_head, whose weight the embedding and the EAGLE
        heads share). exact: refuse a bf16 weight that float16 cannot hold (a target's; a draft head's may round)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias, self.scale = linear.weight.detach().float(), linear.bias, 1.0
        bias = None if bias is None else bias.detach().float()
        if linear.weight.dtype == torch.bfloat16 and exact:
            weight, bias, self.scale = _float16_exact(linear.weight, linear.bias)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        # bf16 prompts' rows: the bf16 weight prepacked for oneDNN too, where it has bf16 kernels (BF16_PROMPT_ROWS)
        self.prompt: Optional[tuple] = None
        if linear.weight.dtype == torch.bfloat16 and not kernels_missing("onednn", torch.bfloat16):
            self.prompt = (
                torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                None if linear.bias is None else linear.bias.detach(),
            )
        self.key = _register(_PACKED_FP16, (self.packed, self.scale, self.prompt), self)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_fp16(x2, self.key, self.out_features)
        else:  # eager: the op itself (a custom op's dispatch costs a little on every call, and a step makes hundreds)
            y = _fp16_linear(x2, self.packed, self.scale, self.prompt)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=packed float16"


# OneDNNLinear runs fewer rows as this many (copies of the first row, results dropped): oneDNN's prepacked bf16
# kernels take another path for one row, and run 1 or 2 rows slower than 4 on AVX512-BF16 CPUs. A row's result is then
# the same bits for any row count.
ONEDNN_PAD_ROWS = 4


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, pad: int
) -> torch.Tensor:
    """x [rows, in] times a prepacked weight, fewer rows than `pad` padded with copies of the first."""
    rows = x.shape[0]
    if rows == 1 and pad > 1:
        x = x.expand(pad, -1)
    elif rows < pad:
        x = torch.cat([x, x[:1].expand(pad - rows, -1)])
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")[:rows]


@torch.library.custom_op("headway::linear_onednn", mutates_args=())
def _linear_onednn_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return _onednn_linear(x, *_PACKED_ONEDNN[key])


@_linear_onednn_op.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class OneDNNLinear(nn.Module):
    """nn.Linear's forward, in the weight's dtype (bf16 or float32), over a copy of its weight prepacked for oneDNN's
    kernels."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep the weight as `.weight` too (see Float16Linear). exact: always (the bf16 weight as is)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the batch-size hint only picks the packed layout; 1..16 rows measured the same with any hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        # bf16 pads few rows (row-exact decoding, and faster); float32 runs one row as one (padding it to 4 rows made
        # the default target's float32 step 1.4x slower), and its decoding is not row-exact in any format
        self.pad = ONEDNN_PAD_ROWS if linear.weight.dtype == torch.bfloat16 else 1
        self.key = _register(_PACKED_ONEDNN, (self.packed, self.bias, self.pad), self)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_onednn(x2, self.key, self.out_features)
        else:
            y = _onednn_linear(x2, self.packed, self.bias, self.pad)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 packed for oneDNN"


# MKL's packed sgemm serves the row count the weight was packed for: one row, a one-token step
MKL_PACKED_ROWS = 1


def _mkl_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] (float32) times a weight packed for MKL: one row through the packed sgemm, any other row count
    through torch's linear over `weight` (the op's own fallback)."""
    return torch.ops.mkl._mkl_linear.default(x, packed, weight, bias, MKL_PACKED_ROWS)


@torch.library.custom_op("headway::linear_mkl", mutates_args=())
def _linear_mkl_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return _mkl_linear(x, *_PACKED_MKL[key])


@_linear_mkl_op.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class MKLLinear(nn.Module):
    """nn.Linear's forward for a float32 weight, one-row calls through a copy of the weight packed for MKL's sgemm
    (the weight as loaded stays, for other row counts)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: always (the other row counts read it). exact: always (the float32 weight as is)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), MKL_PACKED_ROWS)
        self.key = _register(_PACKED_MKL, (self.packed, self.weight.detach(), self.bias), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.headway.linear_mkl(x2, self.key, self.out_features)
        else:
            y = _mkl_linear(x2, self.packed, self.weight.detach(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=float32 packed for MKL"


# StreamLinear's kernel takes calls of up to this many rows (decoding steps: one token, a tree); more (a prompt) read the
# weight better in cache blocks, through oneDNN's linear (its float32 kernels prefilled a 1,000-token prompt 1.2x faster
# than torch's, MKL's, on the AVX512-BF16 EPYC at 1 thread, alike at 2; docs/benchmarks.md)
STREAM_MAX_ROWS = 32


class StreamLinear(nn.Module):
    """nn.Linear's forward for a float32 or bf16 weight, decoding steps through Headway's streaming kernels. float32:
    the weight as loaded, calls of up to STREAM_MAX_ROWS rows (`torch.ops.headway_kernels.stream_linear`), prompts
    through oneDNN's linear over that weight (torch's where torch has no oneDNN). bf16: a copy packed for the bf16
    kernel, calls of fewer than BF16_PROMPT_ROWS rows (`stream_linear_bf16`), every row's bits independent of the row
    count; prompts on a oneDNN-packed copy where the CPU has oneDNN's bf16 kernels (the weight as loaded is then
    dropped unless kept), else in float32 (`_float32_prompt`)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, exact: bool = True):
        """keep_weight: keep a bf16 weight as `.weight` beside its oneDNN copy (the lm_head, whose weight the embedding
        and the EAGLE heads share); float32, or bf16 without oneDNN: always (prompts read it). exact: always (both
        kernels compute in the weight's dtype)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.packed: Optional[torch.Tensor] = None  # bf16: [out / 4, in / 32, 4, 32], the kernel's layout
        # prompts' rows through oneDNN: bf16, (the weight prepacked for it, bias); float32, (the weight as loaded, bias)
        self.prompt: Optional[tuple] = None
        self.key = -1  # the prompt copy's in _PACKED_ONEDNN, for compiled graphs
        if linear.weight.dtype == torch.bfloat16:
            self.packed = torch.ops.headway_kernels.stream_pack_bf16(linear.weight.detach())
            if not kernels_missing("onednn", torch.bfloat16):
                self.prompt = (torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1), self.bias)
                self.key = _register(_PACKED_ONEDNN, (*self.prompt, 1), self)
        elif linear.weight.dtype == torch.float32 and not kernels_missing("onednn", torch.float32):
            self.prompt = (linear.weight.detach(), self.bias)
        if keep_weight or self.prompt is None or self.packed is None:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None:
            y = _stream_bf16(
                x2, self.packed, self.bias, self.out_features, self.prompt, self.key, self._weight()
            )
        else:
            y = _stream_linear(x2, self.weight.detach(), self.bias, self.prompt is not None)
        return y.view(*x.shape[:-1], self.out_features)

    def _weight(self) -> Optional[torch.Tensor]:
        weight = getattr(self, "weight", None)
        return None if weight is None else weight.detach()

    def extra_repr(self) -> str:
        kind = "float32 streamed" if self.packed is None else "bf16 packed for the streaming kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={kind}"


def _stream_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False
) -> torch.Tensor:
    """x [rows, in] times a float32 `weight` [out, in]: a decoding step's float32 rows through the streaming kernel; a
    prompt's through oneDNN's linear over the same weight (`onednn`) or torch's; another dtype's (a float64 head beside
    the target) or a traced graph's (which cannot call the kernel) through torch's linear."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if x.shape[0] > STREAM_MAX_ROWS:
        if onednn and not torch.compiler.is_compiling():
            return _onednn_linear(x, weight, bias, 1)
        return torch.nn.functional.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.headway_kernels.stream_linear(x, weight, bias)


def _stream_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    prompt: Optional[tuple],
    key: int,
    weight: Optional[torch.Tensor],
) -> torch.Tensor:
    """x [rows, in] bf16 times a weight packed for the bf16 streaming kernel: fewer than BF16_PROMPT_ROWS rows through
    it (in a compiled graph too: row-exact decoding needs its bits), a prompt's on the oneDNN copy `prompt` (key: its
    registry entry, for compiled graphs), or where there is none in float32 over `weight` (`_float32_prompt`)."""
    if x.shape[0] < BF16_PROMPT_ROWS:
        return torch.ops.headway_kernels.stream_linear_bf16(x, packed, bias, out_features)
    if prompt is None:
        return _float32_prompt(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.headway.linear_onednn(x, key, out_features)
    return _onednn_linear(x, prompt[0], prompt[1], 1)


def _float32_prompt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 prompt's rows [rows, in] times a bf16 weight [out, in] where oneDNN has no bf16 kernels (AVX2 CPUs):
    in float32 over a float32 copy of the weight made for the call (bf16 products are exact in float32), rounded once
    to bf16. torch's bf16 linear emulates bf16 on such CPUs, ~4x slower than its float32 one (MKL's sgemm); the copy
    costs a small part of that. The C++ layer loop computes the same (`stream` in inference/csrc/layer_loop.cpp)."""
    return torch.nn.functional.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    ).bfloat16()


PACKED = {"float16": Float16Linear, "onednn": OneDNNLinear, "mkl": MKLLinear, "stream": StreamLinear}


def row_linear(module: nn.Module) -> Any:
    """The linear `module` (nn.Linear or a packed format's) as a plain function of rows [n, in]: its kernel called
    directly, without nn.Module dispatch and the reshapes a module does for any input (a decoding step makes
    about a hundred such calls, so per-call overhead shows). Under torch.compile, the module itself (which it traces)."""
    if isinstance(module, OneDNNLinear):
        packed, bias, pad = module.packed, module.bias, module.pad
        return lambda x: module(x) if torch.compiler.is_compiling() else _onednn_linear(x, packed, bias, pad)
    if isinstance(module, Float16Linear):
        packed, scale, prompt = module.packed, module.scale, module.prompt
        return lambda x: (
            module(x) if torch.compiler.is_compiling() else _fp16_linear(x, packed, scale, prompt)
        )
    if isinstance(module, MKLLinear):
        packed, weight, bias = module.packed, module.weight.detach(), module.bias
        return lambda x: module(x) if torch.compiler.is_compiling() else _mkl_linear(x, packed, weight, bias)
    if isinstance(module, StreamLinear):
        if module.packed is not None:
            args = (
                module.packed,
                module.bias,
                module.out_features,
                module.prompt,
                module.key,
                module._weight(),
            )
            return lambda x: _stream_bf16(x, *args)
        weight, bias, onednn = module.weight.detach(), module.bias, module.prompt is not None
        return lambda x: _stream_linear(x, weight, bias, onednn)
    if isinstance(module, nn.Linear):
        return lambda x: torch.nn.functional.linear(x, module.weight, module.bias)
    return module


class FusedLinear(nn.Module):
    """Several linears over the same input as one packed weight (their rows stacked): returns their outputs, views of
    one result. Headway's static engine calls it (`fused_projections`); the model's own forward calls the
    `FusedPart`s that replace the original linears, each of which computes the whole product and keeps its part."""

    def __init__(self, linears: list[nn.Linear], fmt: str, exact: bool = True):
        """exact: as the packed format's (False for a draft head's weights, which may round)."""
        super().__init__()
        biases = [lin.bias for lin in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            biases = [
                torch.zeros(lin.out_features, dtype=lin.weight.dtype) if lin.bias is None else lin.bias
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
    """One of a FusedLinear's linears, for the model's own forward (the HF engine): the whole product, then its part."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.fused = [fused]  # a list: not a second registration of the fused module's state
        self.index = index
        self.in_features, self.out_features = fused.linear.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0](x)[self.index]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of a fused weight"


_FUSED_GROUPS = (
    ("self_attn", "headway_qkv", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "headway_gate_up", ("gate_proj", "up_proj")),
)


def _fuse_layer(layer: nn.Module, fmt: str, exact: bool = True) -> int:
    """Pack a Llama-style layer's q/k/v projections as one weight and its gate/up projections as another, where the
    layer has them as nn.Linear; returns how many linears were packed. exact: as FusedLinear's."""
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


def _swap_linears(module: nn.Module, fmt: str, keep_weight: bool, exact: bool = True) -> int:
    """Every nn.Linear under `module` becomes the packed module of format `fmt`; returns how many."""
    n = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PACKED[fmt](child, keep_weight, exact))
            n += 1
        else:
            n += _swap_linears(child, fmt, keep_weight, exact)
    return n


def pack_head_linear_weights(heads: nn.Module, fmt: str = "float16") -> int:
    """A draft head decoding beside a packed target computes its linears the same way (drafts only steer speed, never
    the output): its decoder layers' q/k/v and gate/up as one product each, as the target's, and every other linear
    packed with its weight kept as `.weight`. Inference only: never train or save a packed head."""
    layers = getattr(getattr(heads, "decoder", None), "layers", [])
    fused = sum(_fuse_layer(layer, fmt, exact=False) for layer in layers)
    return fused + _swap_linears(heads, fmt, keep_weight=True, exact=False)


def fewest_rows(model: Any) -> int:
    """The fewest rows a row-exact (bf16/fp16 CPU) decoding step of this model runs. torch's bf16 linear over one row
    takes another kernel than over two or more (which agree with each other, row by row), so a one-token step pads
    to 2 rows to get the bits a tree's row gets; OneDNNLinear pads its input itself (ONEDNN_PAD_ROWS), and Float16Linear
    gives a bf16 row the same bits for any row count (chunked on CPUs whose fbgemm kernels would not)."""
    return 2 if linear_weights(model) == "native" else 1


# bf16 rows the oneDNN lm_head computes for about the price of its padded ONEDNN_PAD_ROWS on AMX CPUs, where the tiles
# make a row beside the first nearly free and the call streams the weights once (the default target's lm_head, 2
# threads: 16 rows 1.26 ms, 4 rows 1.17 ms; docs/benchmarks.md): a tree step's walk then reads every node's logits
# from one call. oneDNN's bf16 kernels give a row the same bits for any row count of 2 or more.
ONEDNN_AMX_LM_ROWS = 16
# float32 rows the streaming lm_head computes together: 8 cost about 1.8x one (the default target's, 2 threads:
# 1 row 3.3 ms, 4 rows 5.0, 8 rows 5.9; docs/benchmarks.md), where a greedy walk reads about tau rows one by one
STREAM_LM_ROWS = 8


def rows_for_one(model: Any) -> int:
    """How many rows the model's packed lm_head computes for about the price of one: bf16 oneDNN pads to
    ONEDNN_PAD_ROWS anyway, and on AMX runs ONEDNN_AMX_LM_ROWS in about that time (float32 oneDNN, one); fbgemm's
    float16 kernel runs 1-3 rows of the default target's lm_head in about the time of one; the streaming kernel
    STREAM_LM_ROWS for less than two; a native weight, one."""
    fmt = linear_weights(model)
    if fmt == "onednn":
        if next(model.parameters()).dtype != torch.bfloat16:
            return 1
        return ONEDNN_AMX_LM_ROWS if amx_bf16() else ONEDNN_PAD_ROWS
    if fmt == "stream":
        return STREAM_LM_ROWS
    return {"float16": 3}.get(fmt, 1)


def linear_weights(model: Any) -> str:
    """The format of the model's linear weights: native, float16, onednn or mkl (packed by `pack_linear_weights`)."""
    return getattr(model, "headway_linear_weights", "native")


def _check_format(model: Any, fmt: str) -> None:
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
            f"target.linear_weights={fmt}: no kernels for it here ({reason}): use target.linear_weights=native"
        )
    if fmt == "float16" and p.dtype == torch.bfloat16 and not _fbgemm_probe()[1]:
        raise HeadwayError(
            "target.linear_weights=float16 with a bfloat16 target: this CPU's fbgemm float16 kernels give a row "
            "bits that depend on how many rows a call has, so speculative decoding would not equal plain "
            "decoding: use target.linear_weights=native, or target.dtype=float32 with float16 weights"
        )


def kernels_missing(fmt: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why this torch build or CPU cannot run the format's kernels for a target of `dtype`; None when it can."""
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


def pack_linear_weights(model: Any, fmt: str = "float16") -> int:
    """Replace every nn.Linear inside the model's decoder layers, and its lm_head, by the packed module of format
    `fmt` (float16: float32 or bfloat16 CPU targets; onednn: bfloat16 or float32 CPU targets; mkl: float32 CPU
    targets); returns how many. On GPUs, load the target
    in bfloat16 or float16 instead."""
    _check_format(model, fmt)
    count = sum(_fuse_layer(layer, fmt) for layer in model.model.layers)
    count += _swap_linears(model.model.layers, fmt, keep_weight=False)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear):
        model.set_output_embeddings(PACKED[fmt](lm_head, keep_weight=True))
        count += 1
    model.headway_linear_weights = fmt
    return count
