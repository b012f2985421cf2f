"""Training-time test's attention through torch's flex attention and block masks: the CUDA path.

The structured path (train/ttt.py) scores every kept query against every prefix key and keeps the scores
[B, H, N, T] of each step for backward, with additive masks [B, 1, T, T] (step 0) and [B, 1, N, T] (the
later steps): memory that grows with the square of the length. Flex attention computes the same attention
blockwise from a mask function and keeps only its output and log-sum-exp; the block mask skips the blocks
no query sees (above the causal diagonal, and the earlier steps' keys at other positions).

- step 0: query t sees the real keys s <= t (`causal_mask`);
- step j >= 1, queries at the kept positions `index` [B, N], keys step 0's T then N per step 1..j: query n
  sees step 0's real keys s <= index[n], and its own position's key of each step (`step_mask`).

These are the masks the structured path applies (tests/test_ttt.py compares both with the dense unroll).
Torch runs flex attention's backward on CUDA only; on CPUs the structured path trains, and this one runs
forward (the tests). On CUDA the kernel is compiled once per shape bucket (`torch.compile`).
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


@lru_cache(maxsize=None)
def _compiled(compile: bool) -> Callable:
    """flex_attention, compiled (on CUDA: its eager form is a reference that materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False) if compile else flex_attention


@lru_cache(maxsize=None)
def _mask_builder(compile: bool) -> Callable:
    """create_block_mask, compiled on CUDA (eager, it materialises the [B, Q, K] mask it summarises)."""
    return torch.compile(create_block_mask) if compile else create_block_mask


def _compiles(t: torch.Tensor) -> bool:
    """Compile for real CUDA tensors; fake ones (the CPU checks, tests/fake_cuda.py) run eager, since
    compile's tracing needs a CUDA build of torch."""
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
        query: [B, Hq, Q, D]; key, value: [B, Hkv, K, D]; attention_mask: the step's BlockMask (Q x K).
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
    """Step 0's mask: query t sees the real keys s <= t (real: [B, T] bool), of its own sequence in a packed
    batch (doc: [B, T] sequence ids)."""
    B, T = real.shape

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        seen = (kv <= q) & real[b, kv]
        return seen if doc is None else seen & (doc[b, kv] == doc[b, q])

    return _block_mask(mask_mod, B, T, T, real)


def step_mask(
    real: torch.Tensor, index: torch.Tensor, j: int, doc: Optional[torch.Tensor] = None
) -> BlockMask:
    """Step j's mask (j >= 1): query n (at position index[b, n]) sees step 0's real keys s <= index[b, n] (of
    its own sequence, in a packed batch), and key T + (i - 1) N + n of each step i = 1..j (real: [B, T] bool;
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
    """Runs a decoder under `flex_ttt_attention` for the duration of a `with` block; `mask(j)` is step j's
    block mask (real: [B, T] bool; index: [B, N] the kept positions; doc: a packed batch's sequence ids)."""

    def __init__(
        self, decoder: Any, real: torch.Tensor, index: torch.Tensor, doc: Optional[torch.Tensor] = None
    ):
        super().__init__(decoder, FLEX)
        self.real, self.index, self.doc = real, index, doc

    def mask(self, j: int) -> BlockMask:
        if j == 0:
            return causal_mask(self.real, self.doc)
        return step_mask(self.real, self.index, j, self.doc)
