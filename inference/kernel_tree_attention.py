"""Tree attention whose every row reduces over its own virtual sequence, in fixed key blocks: a tree row gives
exactly the bits of the one-token step of its token after its accepted ancestors, and no row's bits depend on
how many rows the call has.

Row i attends to its virtual sequence: virtual position v < start is cache slot v (the committed prefix),
v >= start is slot tails[i][v - start] (its ancestors and itself, by depth), for v < start + lens[i]. That is
the contract of the CPU's row attention (csrc/row_attention.cpp). The keys are taken in blocks of `BLOCK_N`
virtual positions, from the first, with an online softmax in float32, so the reduction order is a function of
the row's own virtual length alone: the plain row of the same token (its ancestors compacted into the prefix)
runs the same loads, the same blocks and the same arithmetic.

Two implementations of that algorithm:
- `_kernel`, in Triton: one program per (row, key-value head), a fixed key block, no split across programs,
  no atomics, no autotune; the row count is the grid and the lengths are read from memory, so nothing the
  compiler specialises on depends on them. bf16 is loaded and computed in float32 (no `tl.dot`: the
  interpreter computes bf16 dots wrongly, triton#11584, and a decode row is memory-bound anyway).
- `reference`, in torch, with the same blocking: on CPU tensors, and where triton is absent. Its dot products
  and sums are pairwise sums of slices (element-wise adds), so a row's bits do not depend on the other rows
  either.

This module imports without triton.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch

try:  # optional: the torch reference serves where it is absent
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None
    tl = None

# keys per block of a row's reduction: fixed, so that the order is the row's own
BLOCK_N = 16


def triton_available() -> bool:
    """Whether the Triton kernel can run here: triton installed, and a CUDA device or the interpreter
    (TRITON_INTERPRET=1, CPU tensors)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` (a power of two long) as a tree of element-wise adds of halves: the same order for
    every row, whatever the tensor's other sizes."""
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim)


def _pad_pow2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x zero-padded along `dim` to a power of two (zeros add nothing to a sum)."""
    size = x.shape[dim]
    full = 1 << max(0, math.ceil(math.log2(size)))
    if full == size:
        return x
    pad = list(x.shape)
    pad[dim] = full - size
    return torch.cat((x, x.new_zeros(pad)), dim)


def virtual_slots(
    v: torch.Tensor, start: torch.Tensor, tails: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots [n, B] of virtual positions v [B] for each row, and whether each is in the row's
    sequence."""
    valid = v[None, :] < (start + lens)[:, None]
    depth = (v - start).clamp(0, tails.shape[1] - 1)
    slot = torch.where(v[None, :] < start, v[None, :], tails.gather(1, depth.expand(tails.shape[0], -1)))
    return torch.where(valid, slot, torch.zeros_like(slot)), valid


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    blocks: Optional[int] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """The kernel's algorithm in torch.

    The scores, exponents and per-block sums of every block are formed at once (element-wise ops and pairwise
    sums, so each is the bits the block would give alone); only the online softmax's running state (the
    row's total and accumulator, rescaled by each block's alpha) goes block by block, as in the kernel.

    Args:
        q: [n, heads, head_dim] (rotated queries); k_cache, v_cache: [kv_heads, slots, head_dim]; start: 0-d
        int64, the committed prefix; tails: [n, depth] int64 slots (row i's first lens[i] used); lens: [n];
        scale: the softmax scale; blocks: key blocks to run (None: enough for the whole cache; blocks past a
        row's length change nothing in it: alpha is 1 and they add zeros); window: a sliding window (a row
        sees the last `window` positions of its sequence; None: all).
    Returns:
        [n, heads * head_dim] in q's dtype."""
    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    group = heads // kv
    # float32, as the kernel computes (float64 for a float64 model, whose tests compare at 1e-10)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = _pad_pow2(q.to(cd).view(n, kv, group, hd), 3)
    if blocks is None:
        blocks = -(-k_cache.shape[1] // BLOCK_N)
    start = torch.as_tensor(start, device=q.device)
    v = torch.arange(blocks * BLOCK_N, device=q.device)
    slot, valid = virtual_slots(v, start, tails, lens)  # [n, blocks * B]
    if window is not None:
        valid = valid & (v[None, :] >= (start + lens)[:, None] - window)
    keys = _pad_pow2(k_cache[:, slot].to(cd).permute(1, 0, 2, 3), 3)  # [n, kv, blocks * B, hd']
    vals = _pad_pow2(v_cache[:, slot].to(cd).permute(1, 0, 2, 3), 3)
    s = _pairwise_sum(qf[:, :, :, None, :] * keys[:, :, None, :, :], 4) * scale  # [n, kv, g, blocks * B]
    s = torch.where(valid[:, None, None, :], s, float("-inf")).view(n, kv, group, blocks, BLOCK_N)
    # the running max after each block, and the one before it (exact: a max rounds nothing)
    m = s.amax(-1).cummax(-1).values  # [n, kv, g, blocks]
    m_before = torch.cat((torch.full_like(m[..., :1], float("-inf")), m[..., :-1]), -1)
    # (a block the window hides whole leaves m at -inf: exponents then subtract 0, not -inf)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    alpha = torch.exp(m_before - m_safe)
    p = torch.exp(s - m_safe[..., None])  # [n, kv, g, blocks, B]
    pv = p[..., None] * vals.view(n, kv, 1, blocks, BLOCK_N, -1)
    # per block: [sum of p*v over its keys (hd'), sum of p], the state the kernel rescales
    adds = torch.cat((_pairwise_sum(pv, 4), _pairwise_sum(p, 4)[..., None]), -1)  # [n, kv, g, blocks, hd'+1]
    state = torch.zeros_like(adds[..., 0, :])
    for b in range(blocks):
        state = state * alpha[..., b, None] + adds[..., b, :]
    out = (state[..., :-1] / state[..., -1:])[..., :hd]
    return out.reshape(n, heads * hd).to(q.dtype)


if triton is not None:

    @triton.jit
    def _kernel(
        Q,
        K,
        V,
        OUT,
        START,
        TAILS,
        LENS,
        scale,
        stride_qn,
        stride_qh,
        stride_kh,
        stride_ks,
        stride_on,
        stride_oh,
        stride_tn,
        window,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HD: tl.constexpr,
        HD_P: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        g = tl.program_id(1)
        start = tl.load(START)
        total = start + tl.load(LENS + row)
        heads = g * GROUP + tl.arange(0, GROUP_P)
        head_ok = tl.arange(0, GROUP_P) < GROUP
        d = tl.arange(0, HD_P)
        d_ok = d < HD
        q = tl.load(
            Q + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        ls = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HD_P], tl.float32)
        for b in range(0, tl.cdiv(total, BLOCK)):
            v = b * BLOCK + tl.arange(0, BLOCK)
            valid = v < total
            seen = valid & (v >= total - window)
            tail = tl.load(TAILS + row * stride_tn + (v - start), mask=valid & (v >= start), other=0)
            slot = tl.where(v < start, v, tail)
            slot = tl.where(valid, slot, 0)
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(K + g * stride_kh + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            ls = ls * alpha + tl.sum(p, axis=1)
            vv = tl.load(V + g * stride_kh + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vv.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        out = acc / ls[:, None]
        tl.store(
            OUT + row * stride_on + heads[:, None] * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=head_ok[:, None] & d_ok[None, :],
        )


def kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """The Triton kernel (see `reference` for the arguments); needs `triton_available()`."""
    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    group = heads // kv
    q, tails = q.contiguous(), tails.contiguous()
    out = torch.empty_like(q)
    start = torch.as_tensor(start, device=q.device).view(1)
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("internal: the tree attention kernel takes contiguous, alike key and value caches")
    # launched on the tensors' device, not the current one (Triton launches on the current device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _launch(q, k_cache, v_cache, out, start, tails, lens, scale, window, n, kv, group, hd)
    return out.reshape(n, heads * hd)


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: Optional[int],
    n: int,
    kv: int,
    group: int,
    hd: int,
) -> None:
    """The kernel's launch over the (row, key-value head) grid."""
    _kernel[(n, kv)](
        q,
        k_cache,
        v_cache,
        out,
        start,
        tails,
        lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        tails.stride(0),
        window if window is not None else 2**31 - 1,
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        HD=hd,
        HD_P=triton.next_power_of_2(hd),
        BLOCK=BLOCK_N,
    )


@torch.library.custom_op("headway::tree_attention", mutates_args=())
def _tree_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """The kernel as one opaque op (window -1: none): fake tensors and torch.compile see its shape alone."""
    return kernel(q, k_cache, v_cache, start, tails, lens, scale, None if window < 0 else window)


@_tree_attention_op.register_fake
def _(q, k_cache, v_cache, start, tails, lens, scale, window):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    interpret: bool = False,
    blocks: Optional[int] = None,
) -> torch.Tensor:
    """Row-exact tree attention: the Triton kernel on CUDA (or, with `interpret`, in the interpreter on CPU
    tensors), else the torch reference. Arguments and result as `reference` (`blocks` serves the reference
    alone: the kernel stops at each row's own length)."""
    if triton_available() and (q.is_cuda or interpret):
        win = -1 if window is None else int(window)
        return torch.ops.headway.tree_attention(q, k_cache, v_cache, start, tails, lens, float(scale), win)
    return reference(q, k_cache, v_cache, start, tails, lens, scale, blocks=blocks, window=window)
