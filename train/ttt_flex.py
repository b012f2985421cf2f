"""Training-time test's attention through torch's flex attention and block masks: the CUDA path.

The structured path (train/ttt.py) scores every kept query against every prefix key and keeps the
scores [B, H, N, T] of each step for backward, with additive masks [B, 1, T, T] (step 0) and [B, 1,
N, T] (the later steps): memory that grows with the square of the length. Flex attention computes
the same attention blockwise from a mask function and keeps only its output and log-sum-exp; the
block mask skips the blocks no query sees (above the causal diagonal, and the earlier steps' keys at
other positions).

- step 0: query t sees the real keys s <= t (`causal_mask`);
- step j >= 1, queries at the kept positions `index` [B, N], keys step 0's T then N per step 1..j:
  query n sees step 0's real keys s <= index[n], and its own position's key of each step
  (`step_mask`).

These are the masks the structured path applies (tests/train/test_ttt.py compares both with the
dense unroll). Torch runs flex attention's backward on CUDA only; on CPUs the structured path
trains, and this one runs forward (the tests).

On CUDA the kernel is compiled (`torch.compile`, static shapes) once per shape: the head's sequence
length T and the kept positions' count N are padded up to buckets (train.flex_buckets; the padding
is masked out), so the run compiles at most `len(flex_shapes(buckets, steps))` shapes per grad mode,
all warmed before step 1 (`warm_flex`); Dynamo's recompile limit is raised to that count and a hit
raises (`limit_compiles`), since past it Dynamo would run flex eagerly: the unfused reference, fp32
[B, H, Q, K] scores, out of memory.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface

from headway.errors import HeadwayError
from headway.train.attention_swap import UnderAttention

# The attention implementation every step runs under on the flex path (registered once, below).
FLEX = "headway_ttt_flex"
# Flex attention's query and key block; the block mask is built at this granularity.
BLOCK = 128


def length_buckets(setting: list[int], longest: int) -> tuple[int, ...]:
    """train.flex_buckets resolved for rows of up to `longest` tokens: as given (its largest must
    hold them), or powers of two from 256 up to the first that does."""
    if setting:
        if setting[-1] < longest:
            raise HeadwayError(
                f"train.flex_buckets' largest, {setting[-1]}, is shorter than the longest row ({longest} "
                "tokens): add a bucket that holds it"
            )
        return tuple(setting)
    out = [256]
    while out[-1] < longest:
        out.append(out[-1] * 2)
    return tuple(out)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `n`."""
    for b in buckets:
        if b >= n:
            return b
    raise HeadwayError(f"a length of {n} is longer than train.flex_buckets' largest, {buckets[-1]}")


def flex_shapes(buckets: tuple[int, ...], steps: int) -> list[tuple[int, int, int]]:
    """Every compile a flex call can need under `buckets` for `steps` TTT steps, as (T, N, j): step
    0's (T, T, 0), queries and keys T; step j's (T, N, j) for each bucket N <= T, N queries and T +
    jN keys (the block mask's T is part of the compiled function, so two steps with one (queries,
    keys) shape but another T are two compiles)."""
    shapes = [(t, t, 0) for t in buckets]
    shapes += [(t, n, j) for t in buckets for n in buckets if n <= t for j in range(1, steps)]
    return shapes


def limit_compiles(shapes: int) -> None:
    """Let Dynamo compile flex attention and its block masks at `shapes` shapes in each grad mode
    (training, evaluation) and make a hit of that limit an error: past it Dynamo would run flex
    eagerly, silently."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * shapes)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * shapes)
    config.fail_on_recompile_limit_hit = True


def pad_to(x: torch.Tensor, length: int, fill: float = 0) -> torch.Tensor:
    """`x` [B, T, ...] padded with `fill` to `length` along dim 1."""
    if x.shape[1] == length:
        return x
    pad = x.new_full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1)


def warm_flex(
    layer_config: Any,
    batch: int,
    buckets: tuple[int, ...],
    steps: int,
    dtype: torch.dtype,
    device: torch.device,
    backward: bool = True,
) -> int:
    """Compile flex attention and its block masks at every shape `flex_shapes` admits, for
    micro-batches of `batch` rows, with and without gradients, before step 1: every rank compiles
    the same shapes at the same time (not one rank inside the first steps while the others wait in a
    collective). Returns the shapes run; on anything but a real CUDA device nothing is compiled and
    this only checks the calls."""
    heads = layer_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads
    shapes = 0
    for T in buckets:
        real = torch.ones(batch, T, dtype=torch.bool, device=device)
        calls = [(T, 0), *((n, j) for n in buckets if n <= T for j in range(1, steps))]
        for N, j in calls:
            mask = (
                causal_mask(real)
                if j == 0
                else step_mask(real, torch.zeros(batch, N, dtype=torch.long, device=device), j)
            )
            Q, K = (T, T) if j == 0 else (N, T + j * N)
            for grad in (True, False) if backward else (False,):
                q = torch.zeros(
                    batch, heads, Q, dim, dtype=dtype, device=device, requires_grad=grad
                )
                k = torch.zeros(
                    batch, kv_heads, K, dim, dtype=dtype, device=device, requires_grad=grad
                )
                v = torch.zeros(
                    batch, kv_heads, K, dim, dtype=dtype, device=device, requires_grad=grad
                )
                with torch.set_grad_enabled(grad):
                    out, _ = flex_ttt_attention(_Module(), q, k, v, mask)
                    if grad:
                        out.sum().backward()
            shapes += 1
    return shapes


class _Module:
    """What `flex_ttt_attention` reads of the calling attention module: that it runs no dropout."""

    training = False


@lru_cache(maxsize=None)
def _compiled(compile: bool) -> Callable:
    """flex_attention, compiled (on CUDA: its eager form is a reference that materialises the
    scores)."""
    return torch.compile(flex_attention, dynamic=False) if compile else flex_attention


@lru_cache(maxsize=None)
def _mask_builder(compile: bool) -> Callable:
    """create_block_mask, compiled on CUDA (eager, it materialises the [B, Q, K] mask it
    summarises)."""
    return torch.compile(create_block_mask) if compile else create_block_mask


def _compiles(t: torch.Tensor) -> bool:
    """Compile for real CUDA tensors; fake ones (the CPU checks, tests/helpers/fake_cuda.py) run
    eager, since compile's tracing needs a CUDA build of torch."""
    return t.is_cuda and not is_fake(t)


def flex_ttt_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function over a BlockMask.

    Args:
        query: [B, Hq, Q, D]; key, value: [B, Hkv, K, D]; attention_mask: the step's BlockMask (Q x
            K). Query, key and value reach the kernel in one dtype: the autocast dtype when autocast
            is on (the head's rotary embedding, in its parameters' dtype, promotes q and k past a
            low-precision v under DDP's float32 parameters), else the value's.
    Returns:
        ([B, Q, Hq, D], None), as transformers' own attention functions return.
    """
    if kwargs.get("s_aux") is not None:
        raise HeadwayError("training-time test does not support attention sinks in the draft layer")
    if dropout and module.training:
        raise HeadwayError("train.ttt_attention=flex has no attention dropout: use structured")
    score_mod = None
    if softcap is not None:

        def score_mod(score: torch.Tensor, b: Any, h: Any, q: Any, k: Any) -> torch.Tensor:
            return torch.tanh(score / softcap) * softcap

    dtype = (
        torch.get_autocast_dtype(query.device.type)
        if torch.is_autocast_enabled(query.device.type)
        else None
    )
    dtype = dtype or query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = _compiled(_compiles(query))(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX, flex_ttt_attention)


def _block_mask(mask_mod: Callable, B: int, Q: int, K: int, probe: torch.Tensor) -> BlockMask:
    build = _mask_builder(_compiles(probe))
    return build(mask_mod, B, None, Q, K, device=probe.device, BLOCK_SIZE=BLOCK)


def causal_mask(real: torch.Tensor, doc: Optional[torch.Tensor] = None) -> BlockMask:
    """Step 0's mask: query t sees the real keys s <= t (real: [B, T] bool), of its own sequence in
    a packed batch (doc: [B, T] sequence ids)."""
    B, T = real.shape

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        seen = (kv <= q) & real[b, kv]
        return seen if doc is None else seen & (doc[b, kv] == doc[b, q])

    return _block_mask(mask_mod, B, T, T, real)


def step_mask(
    real: torch.Tensor, index: torch.Tensor, j: int, doc: Optional[torch.Tensor] = None
) -> BlockMask:
    """Step j's mask (j >= 1): query n (at position index[b, n]) sees step 0's real keys s <=
    index[b, n] (of its own sequence, in a packed batch), and key T + (i - 1) N + n of each step i =
    1..j (real: [B, T] bool;
    index: [B, N]; doc: [B, T] sequence ids or None)."""
    B, T = real.shape
    N = index.shape[1]

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        s = torch.clamp(kv, max=T - 1)
        prefix = (kv < T) & (kv <= index[b, q]) & real[b, s]
        if doc is not None:
            prefix = prefix & (doc[b, s] == doc[b, index[b, q]])
        own = (kv >= T) & ((kv - T) % N == q)
        return prefix | own

    return _block_mask(mask_mod, B, N, T + j * N, real)


class FlexAttention(UnderAttention):
    """Runs a decoder under `flex_ttt_attention` for the duration of a `with` block; `mask(j)` is
    step j's block mask (real: [B, T] bool; index: [B, N] the kept positions; doc: a packed batch's
    sequence ids)."""

    def __init__(
        self,
        decoder: Any,
        real: torch.Tensor,
        index: torch.Tensor,
        doc: Optional[torch.Tensor] = None,
    ):
        super().__init__(decoder, FLEX)
        self.real, self.index, self.doc = real, index, doc

    def mask(self, j: int) -> BlockMask:
        if j == 0:
            return causal_mask(self.real, self.doc)
        return step_mask(self.real, self.index, j, self.doc)
