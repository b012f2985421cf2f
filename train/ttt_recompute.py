"""Training-time test's attention with its scores recomputed in backward: memory flat in the length,
on CPUs.

The structured path (train/ttt.py) keeps each step's scores [B, H, N, T] and additive masks for
backward, which grow with the square of the length. This path computes attention in chunks of
queries, as flash attention does, and keeps only its inputs, its output and the log-sum-exp of each
query; backward recomputes each chunk's scores and forms the gradients from them (the
flash-attention backward). The mask is never materialised beyond one chunk: query n, at position
index[b, n], sees step 0's real keys s <= index[b, n] and its own position's key of each earlier
step. Step 0 is the case of every position and no earlier step.

Its loss and gradients equal the dense unroll's (tests/train/test_ttt.py, float64). It is
`train.ttt_attention= recompute`; CPU runs keep `structured` by default, whose bits the shipped
recipes' loss curves were made with.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface

from headway.errors import HeadwayError
from headway.train.attention_swap import UnderAttention

# The attention implementation every step runs under on this path (registered once, below).
RECOMPUTE = "headway_ttt_recompute"
# Queries per chunk: one chunk's scores [B, H, chunk, T] are the largest tensor alive at once.
CHUNK = 256

# the running unroll's index [B, N] and real [B, T] (`Recompute`)
_current: dict[str, torch.Tensor] = {}


def _scores(q, k0, kd, index, real, doc, scale):
    """One chunk's scores: against step 0's keys (masked) [B, Hkv, g, c, T], and its own keys [..,
    c, j]."""
    T = k0.shape[2]
    pre = torch.einsum("bhgnd,bhsd->bhgns", q, k0) * scale
    # [B, c, T]
    seen = (torch.arange(T, device=q.device) <= index.unsqueeze(-1)) & real.unsqueeze(1)
    if doc.numel():  # a packed batch: the query's own sequence only
        seen = seen & (doc.unsqueeze(1) == doc.gather(1, index).unsqueeze(-1))
    pre = pre.masked_fill(~seen[:, None, None], torch.finfo(pre.dtype).min)
    own = torch.einsum("bhgnd,bhjnd->bhgnj", q, kd) * scale
    return pre, own


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k0, v0, kd, vd, index, real, doc, scale: float, chunk: int):
        """q [B, Hkv, g, N, D]; k0, v0 [B, Hkv, T, D]; kd, vd [B, Hkv, j, N, D]; index [B, N]; real
        [B, T]; doc [B, T] sequence ids, or empty (right-padded rows)."""
        N = q.shape[3]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
        for a in range(0, N, chunk):
            b = min(N, a + chunk)
            pre, own = _scores(
                q[:, :, :, a:b], k0, kd[:, :, :, a:b], index[:, a:b], real, doc, scale
            )
            m = torch.logsumexp(torch.cat([pre, own], dim=-1), dim=-1)
            lse[:, :, :, a:b] = m
            p_pre, p_own = (pre - m.unsqueeze(-1)).exp(), (own - m.unsqueeze(-1)).exp()
            out[:, :, :, a:b] = torch.einsum("bhgns,bhsd->bhgnd", p_pre, v0) + torch.einsum(
                "bhgnj,bhjnd->bhgnd", p_own, vd[:, :, :, a:b]
            )
        ctx.save_for_backward(q, k0, v0, kd, vd, index, real, doc, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        # backward recomputes the scores under the forward's autocast (as torch.amp.custom_bwd
        # does): `backward()` runs outside the objective's autocast, and scores recomputed in
        # float32 against a log-sum-exp of bf16 scores would give rows that do not sum to one
        kind = q.device.type
        # (a device with no autocast, e.g. meta in the memory tests: nothing to restore)
        ctx.autocast = None
        if torch.amp.is_autocast_available(kind):
            ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor):
        if ctx.autocast is None:
            return _Attention._backward(ctx, d_out)
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return _Attention._backward(ctx, d_out)

    @staticmethod
    def _backward(ctx: Any, d_out: torch.Tensor):
        q, k0, v0, kd, vd, index, real, doc, out, lse = ctx.saved_tensors
        scale, chunk, N = ctx.scale, ctx.chunk, q.shape[3]
        dq, dkd, dvd = torch.empty_like(q), torch.empty_like(kd), torch.empty_like(vd)
        dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
        for a in range(0, N, chunk):
            b = min(N, a + chunk)
            qc, kdc, vdc, do = (
                q[:, :, :, a:b],
                kd[:, :, :, a:b],
                vd[:, :, :, a:b],
                d_out[:, :, :, a:b],
            )
            pre, own = _scores(qc, k0, kdc, index[:, a:b], real, doc, scale)
            m = lse[:, :, :, a:b].unsqueeze(-1)
            p_pre, p_own = (pre - m).exp(), (own - m).exp()
            delta = (do * out[:, :, :, a:b]).sum(-1, keepdim=True)
            ds_pre = p_pre * (torch.einsum("bhgnd,bhsd->bhgns", do, v0) - delta) * scale
            ds_own = p_own * (torch.einsum("bhgnd,bhjnd->bhgnj", do, vdc) - delta) * scale
            dq[:, :, :, a:b] = torch.einsum("bhgns,bhsd->bhgnd", ds_pre, k0) + torch.einsum(
                "bhgnj,bhjnd->bhgnd", ds_own, kdc
            )
            dk0 += torch.einsum("bhgns,bhgnd->bhsd", ds_pre, qc)
            dv0 += torch.einsum("bhgns,bhgnd->bhsd", p_pre, do)
            dkd[:, :, :, a:b] = torch.einsum("bhgnj,bhgnd->bhjnd", ds_own, qc)
            dvd[:, :, :, a:b] = torch.einsum("bhgnj,bhgnd->bhjnd", p_own, do)
        return dq, dk0, dv0, dkd, dvd, None, None, None, None, None


def recompute_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A step's attention as a transformers attention function (the mask comes from `Recompute`).

    Args:
        query: [B, Hq, N, D] at the step's positions; key, value: [B, Hkv, T + j N, D], step 0's T
            keys then N per earlier step (the cache's concatenation).
    Returns:
        ([B, N, Hq, D], None), as transformers' own attention functions return.
    """
    if kwargs.get("s_aux") is not None or softcap is not None:
        raise HeadwayError(
            "train.ttt_attention=recompute supports neither attention sinks nor soft-capping: use structured"
        )
    if dropout and module.training:
        raise HeadwayError("train.ttt_attention=recompute has no attention dropout: use structured")
    index, real, doc = _current["index"], _current["real"], _current["doc"]
    B, Hq, N, D = query.shape
    Hkv, T = key.shape[1], real.shape[1]
    j = (key.shape[2] - T) // N
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.reshape(B, Hkv, Hq // Hkv, N, D).to(acc)
    k0, v0 = key[:, :, :T].to(acc), value[:, :, :T].to(acc)
    kd = key[:, :, T:].reshape(B, Hkv, j, N, D).to(acc)
    vd = value[:, :, T:].reshape(B, Hkv, j, N, D).to(acc)
    scale = D**-0.5 if scaling is None else scaling
    out = _Attention.apply(q, k0, v0, kd, vd, index, real, doc, scale, CHUNK)
    return out.to(query.dtype).reshape(B, Hq, N, D).transpose(1, 2).contiguous(), None


AttentionInterface.register(RECOMPUTE, recompute_attention)


class Recompute(UnderAttention):
    """Runs a decoder under `recompute_attention` inside a `with` block; `mask(j)` readies step j
    (step 0 at every row index, later steps at the kept ones) and returns no mask: the attention
    builds its own chunk by chunk (real: [B, T] bool; index: [B, N]; doc: a packed batch's sequence
    ids)."""

    def __init__(
        self,
        decoder: Any,
        real: torch.Tensor,
        index: torch.Tensor,
        doc: Optional[torch.Tensor] = None,
    ):
        super().__init__(decoder, RECOMPUTE)
        self.real, self.index = real, index
        self.doc = doc if doc is not None else real.new_zeros((0,), dtype=torch.long)

    def mask(self, j: int) -> None:
        B, T = self.real.shape
        rows = torch.arange(T, device=self.real.device).expand(B, T) if j == 0 else self.index
        _current.update(index=rows, real=self.real, doc=self.doc)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _current.clear()
