"""Training-time test: the EAGLE-3 drafter unrolled on its own outputs, computing only what a loss
reads.

Step j at position t stands for drafting j tokens past t: it reads token t+1+j at position t+j and
attends to the real prefix (step 0's keys at positions <= t) plus its own earlier steps at t, the
attention the drafter has at inference when it extends a chain from t. Step 0 runs at every position
(its keys feed every later query). A step j >= 1 output at t feeds only losses at t (its own and the
later steps'), so steps j >= 1 run only at the positions where some step from 1 on takes a loss,
about the answer tokens of a batch, and their attention is structured rather than masked densely:
each query scores step 0's keys causally and its own position's keys of the earlier steps one by
one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import AttentionInterface, DynamicCache

from headway.errors import HeadwayError
from headway.heads.draft_layer import drafter_mask
from headway.train.attention_swap import UnderAttention
from headway.train.ttt_flex import FlexAttention, bucket, pad_to
from headway.train.ttt_recompute import Recompute

# The attention implementation steps j >= 1 run under (registered once with transformers, below).
ATTENTION = "headway_ttt"


def causal_allowed(
    attention_mask: torch.Tensor, doc: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[B, T, T] bool: position t sees real positions s <= t (of its own sequence, in a packed
    batch: `doc` [B, T], train/packing.py)."""
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    return allowed if doc is None else allowed & (doc.unsqueeze(-1) == doc.unsqueeze(1))


def ttt_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a step j >= 1 of the unroll, as a transformers attention function.

    Args:
        query: [B, Hq, N, D], the N kept positions of this step.
        key, value: [B, Hkv, T + j N, D]: step 0's T positions, then N per earlier step j' >= 1 (the
            cache's concatenation).
        attention_mask: [B, 1, N, T] additive mask of step 0's keys each query may see.
    Returns:
        ([B, N, Hq, D], None), as transformers' own attention functions return.
    """
    if kwargs.get("s_aux") is not None:
        raise HeadwayError("training-time test does not support attention sinks in the draft layer")
    B, Hq, N, D = query.shape
    Hkv, T = key.shape[1], attention_mask.shape[-1]
    j = (key.shape[2] - T) // N
    g = Hq // Hkv
    scale = D**-0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, g, N, D)
    k0, v0 = key[:, :, :T], value[:, :, :T]
    kd = key[:, :, T:].reshape(B, Hkv, j, N, D)
    vd = value[:, :, T:].reshape(B, Hkv, j, N, D)
    prefix = torch.einsum("bhgnd,bhsd->bhgns", q, k0) * scale
    own = torch.einsum("bhgnd,bhjnd->bhgnj", q, kd) * scale
    if softcap is not None:
        prefix, own = (torch.tanh(s / softcap) * softcap for s in (prefix, own))
    prefix = prefix + attention_mask.unsqueeze(2)
    scores = torch.cat([prefix, own], dim=-1)
    weights = torch.softmax(
        scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)
    ).to(query.dtype)
    if dropout and module.training:
        weights = torch.nn.functional.dropout(weights, p=dropout)
    out = torch.einsum("bhgns,bhsd->bhgnd", weights[..., :T], v0)
    out = out + torch.einsum("bhgnj,bhjnd->bhgnd", weights[..., T:], vd)
    return out.reshape(B, Hq, N, D).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ttt_attention)


@dataclass
class Unrolled:
    """The unroll's outputs. outputs[0]: [B, T, h] at every position; outputs[j >= 1]: [B, N, h] at
    the kept positions `index` [B, N] (rows padded with position 0, `kept` [B, N] False there)."""

    outputs: list[torch.Tensor]
    index: torch.Tensor
    kept: torch.Tensor

    def at(self, j: int, values: torch.Tensor) -> torch.Tensor:
        """`values` [B, T, ...] in step j's layout: as is for step 0, gathered at the kept positions
        after."""
        if j == 0:
            return values
        idx = self.index.reshape(*self.index.shape, *([1] * (values.dim() - 2))).expand(
            -1, -1, *values.shape[2:]
        )
        return values.gather(1, idx)


def kept_positions(needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's True positions of `needed` [B, T], padded to the longest row: (index [B, N], kept
    [B, N])."""
    counts = needed.sum(1)
    N = max(1, int(counts.max())) if needed.numel() else 1
    T = needed.shape[1]
    # a stable sort puts each row's needed positions first, in order
    order = torch.sort((~needed).to(torch.int8), dim=1, stable=True).indices[:, :N]
    kept = torch.arange(N, device=needed.device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(kept, order, torch.zeros_like(order)).clamp(max=T - 1), kept


def shifted(x: torch.Tensor, by: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t + by] at position t, `fill` past the end (dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def ttt_unroll(
    heads: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
    needed: Optional[torch.Tensor] = None,
    kept: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    attention: str = "structured",
    positions: Optional[torch.Tensor] = None,
    doc: Optional[torch.Tensor] = None,
    buckets: tuple[int, ...] = (),
) -> Unrolled:
    """The drafter unrolled `steps` times on its own outputs (see the module docstring).

    Args:
        heads: an EAGLE head (`forward(tokens, hidden, position_ids, mask, cache)`, `next_hidden`).
        ids: [B, T] token ids; attn: [B, T] 1 on real tokens; hidden: [B, T, h], step 0's input.
        needed: [B, T] bool, the positions steps j >= 1 must compute; None = all of them.
        kept: (index, kept) [B, N], `kept_positions(needed)` worked out on the host beforehand (the
            objective's plan), so that the unroll reads nothing back from the device; overrides
            `needed`.
        attention: structured (additive masks, the scores kept for backward), flex (block masks,
            train/ttt_flex.py; its backward runs on CUDA only) or recompute (scores recomputed in
            backward, train/ttt_recompute.py).
        positions, doc: [B, T] a packed batch's positions and sequence ids (None: right-padded
            rows).
        buckets: with flex, the lengths T is padded up to (train.flex_buckets: one compile per
            bucket); the padding is no real token, and step 0's output is cut back to T.
    Returns:
        an `Unrolled` with each step's layer output.
    """
    B, T = ids.shape
    if attention == "flex" and buckets and bucket(T, buckets) != T:
        padded = bucket(T, buckets)
        pos = (
            torch.arange(padded, device=ids.device).expand(B, -1)
            if positions is None
            else positions
        )
        unrolled = ttt_unroll(
            heads,
            pad_to(ids, padded),
            pad_to(attn, padded),
            pad_to(hidden, padded),
            steps,
            needed if needed is None else pad_to(needed, padded, False),
            kept,
            attention,
            pad_to(pos, padded),
            None if doc is None else pad_to(doc, padded, -1),
        )
        unrolled.outputs[0] = unrolled.outputs[0][:, :T]
        return unrolled
    if kept is not None:
        index, kept_mask = kept
    elif needed is not None:
        index, kept_mask = kept_positions(needed)
    else:  # every position: no host read
        index = torch.arange(T, device=ids.device).expand(B, T)
        kept_mask = torch.ones(B, T, dtype=torch.bool, device=ids.device)
    cache = DynamicCache(config=heads.decoder.config)
    pos = torch.arange(T, device=ids.device).unsqueeze(0) if positions is None else positions
    # step j >= 1 runs at the kept positions' own positions, j on
    kept_pos = index if positions is None else positions.gather(1, index)
    if attention in ("flex", "recompute"):
        under = FlexAttention if attention == "flex" else Recompute
        context = under(heads.decoder, attn.bool(), index, doc)
        return _unroll_under(
            context, heads, ids, hidden, steps, index, kept_mask, cache, pos, kept_pos
        )
    allowed = causal_allowed(attn, doc)
    dtype = heads.fc.weight.dtype
    out = heads(shifted(ids, 1), hidden, pos, drafter_mask(allowed, dtype), cache)
    unrolled = Unrolled([out], index, kept_mask)
    if steps == 1:
        return unrolled
    # step 0's keys each kept query sees, once for all later steps
    prefix = drafter_mask(allowed.gather(1, index.unsqueeze(-1).expand(-1, -1, T)), dtype)
    hidden = unrolled.at(1, heads.next_hidden(out))
    with UnderAttention(heads.decoder, ATTENTION):
        for j in range(1, steps):
            tokens = unrolled.at(1, shifted(ids, 1 + j))
            out = heads(tokens, hidden, kept_pos + j, prefix, cache)
            unrolled.outputs.append(out)
            hidden = heads.next_hidden(out)
    return unrolled


def _unroll_under(
    attention: Any,
    heads: Any,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
    index: torch.Tensor,
    kept_mask: torch.Tensor,
    cache: Any,
    pos: torch.Tensor,
    kept_pos: torch.Tensor,
) -> Unrolled:
    """`ttt_unroll` with every step under `attention` (FlexAttention or Recompute): a context whose
    `mask(j)` is the attention_mask argument of step j (no [T, T] or [N, T] tensor on either)."""
    with attention:
        out = heads(shifted(ids, 1), hidden, pos, attention.mask(0), cache)
        unrolled = Unrolled([out], index, kept_mask)
        hidden = unrolled.at(1, heads.next_hidden(out))
        for j in range(1, steps):
            tokens = unrolled.at(1, shifted(ids, 1 + j))
            out = heads(tokens, hidden, kept_pos + j, attention.mask(j), cache)
            unrolled.outputs.append(out)
            hidden = heads.next_hidden(out)
    return unrolled
