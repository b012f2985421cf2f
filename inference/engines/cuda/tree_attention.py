"""Tree attention whose every row reduces over its own virtual sequence, in fixed key blocks: a tree
row gives exactly the bits of the one-token step of its token after its accepted ancestors, and no
row's bits depend on how many rows the call has.

Row i attends to its virtual sequence: virtual position v < start is cache slot v (the committed
prefix), v >= start is slot tails[i][v - start] (its ancestors and itself, by depth), for v < start
+ lens[i]. That is the contract of the CPU's row attention (csrc/row_attention.cpp). The keys are
taken in blocks of `BLOCK_N` virtual positions, from the first (a sliding-window row: its window's
first), with an online softmax in float32, so the reduction order is a function of the row's own
virtual length alone: the plain row of the same token (its ancestors compacted into the prefix) runs
the same loads, the same blocks and the same arithmetic.

Two implementations of that algorithm:
- `_split_kernel` and `_combine_kernel`, in Triton, whose work follows the real rows: one program
  per (tile of rows, key-value head, split of the sequence). Rows past the step's real count (a
  device tensor) and tiles of them read nothing. A tile's rows share each block's prefix keys and
  values (one load for all the rows and query heads of a key-value head); each row loads only its
  own ancestors' slots. A row's sequence is split every `SPLIT_N` keys (points fixed by its own
  length), each split's state (max, sum, accumulator) is written out, and the combine merges the
  row's splits in order; a sliding-window row starts at its window's first block. A block outside a
  row's own range leaves its state bit for bit unchanged, and every row of a tile runs the same
  instructions on its own slice, so a row's bits depend on its virtual sequence and the kernel's
  shape (`block_n`, `split_n`, rows per program: fixed per model) alone, never on the other rows or
  the bucket. No atomics (but the tests' block counter), no autotune; the row count is the grid and
  the lengths are read from memory. bf16 is loaded and computed in float32 (no `tl.dot`: the
  interpreter computes bf16 dots wrongly, triton#11584, and a decode row is memory-bound anyway).
- `reference`, in torch, with the same blocking, each row unsplit: on CPU tensors, and where triton
  is absent. Its dot products and sums are pairwise sums of slices (element-wise adds), so a row's
  bits do not depend on the other rows either.

This module imports without triton.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import NamedTuple, Optional

import torch

try:  # optional: the torch reference serves where it is absent
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None
    tl = None

# keys per block of a row's reduction: fixed, so that the order is the row's own
BLOCK_N = 16
# keys per split of a row's sequence (a multiple of BLOCK_N): split s reduces the row's blocks from
# s * SPLIT_N / BLOCK_N on, and a row's splits are combined in order, so where a row splits depends
# on its own length alone
SPLIT_N = 1024
# query heads per program: a program takes QUERY_TILE / group rows of one key-value head
# (rows_per_program)
QUERY_TILE = 16


def triton_available() -> bool:
    """Whether the Triton kernel can run here: triton installed, and a CUDA device or the
    interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return triton is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    )


def _pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` (a power of two long) as a tree of element-wise adds of halves: the same
    order for every row, whatever the tensor's other sizes."""
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
    slot = torch.where(
        v[None, :] < start, v[None, :], tails.gather(1, depth.expand(tails.shape[0], -1))
    )
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
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The kernel's algorithm in torch, each row unsplit (its bits are its own, as the kernel's
    are).

    The scores, exponents and per-block sums of every block are formed at once (element-wise ops and
    pairwise sums, so each is the bits the block would give alone); only the online softmax's
    running state (the row's total and accumulator, rescaled by each block's alpha) goes block by
    block, as in the kernel.

    Args:
        q: [n, heads, head_dim] (rotated queries); k_cache, v_cache: [kv_heads, slots, head_dim];
            start: 0-d
        int64, the committed prefix; tails: [n, depth] int64 slots (row i's first lens[i] used);
        lens: [n];
        scale: the softmax scale; blocks: key blocks to run (None: enough for the whole cache;
            blocks past a
        row's length change nothing in it: alpha is 1 and they add zeros); window: a sliding window
        (a row sees the last `window` positions of its sequence; None: all); rows: the real row
        count (a tensor;
        None: every row), past which rows give zeros, as in the kernel.
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
    # [n, kv, g, blocks * B]
    s = _pairwise_sum(qf[:, :, :, None, :] * keys[:, :, None, :, :], 4) * scale
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
    # [n, kv, g, blocks, hd'+1]
    adds = torch.cat((_pairwise_sum(pv, 4), _pairwise_sum(p, 4)[..., None]), -1)
    state = torch.zeros_like(adds[..., 0, :])
    for b in range(blocks):
        state = state * alpha[..., b, None] + adds[..., b, :]
    out = (state[..., :-1] / state[..., -1:])[..., :hd].reshape(n, heads * hd)
    if rows is not None:
        real = torch.arange(n, device=q.device) < torch.as_tensor(rows, device=q.device).reshape(())
        out = torch.where(real[:, None], out, torch.zeros_like(out))
    return out.to(q.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q,
        K,
        V,
        M_PART,
        L_PART,
        ACC_PART,
        START,
        TAILS,
        LENS,
        REAL,
        COUNTER,
        scale,
        rows,
        heads_total,
        splits,
        stride_qn,
        stride_qh,
        stride_kh,
        stride_ks,
        stride_tn,
        window,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HD: tl.constexpr,
        HD_P: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr,
        ROWS: tl.constexpr,
        COUNT: tl.constexpr,
    ):
        """One (row tile, key-value head, split): the online-softmax state of each of the tile's
        real rows over its blocks in the split, written to the partials. Each block's prefix keys
        and values are loaded once for the whole tile; each row loads only its own tail's
        (ancestors') slots."""
        tile = tl.program_id(0)
        g = tl.program_id(1)
        split = tl.program_id(2)
        start = tl.load(START)
        real = tl.minimum(tl.load(REAL), rows)
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < real
        total = tl.where(row_ok, start + tl.load(LENS + r, mask=row_ok, other=0), 0)
        # the tile's blocks in this split: from its rows' first window block to their last block
        # (pad rows and pad tiles: none). A block outside a row's own range leaves the row's state
        # unchanged (alpha 1, p 0; or an untouched zero state), so the tile's other rows never
        # change a row's bits
        first = tl.maximum(total - window, 0) // BLOCK
        lo = tl.maximum(tl.min(tl.where(row_ok, first, 2**30)), split * SPLIT_BLOCKS)
        hi = tl.minimum(tl.max(tl.cdiv(total, BLOCK)), (split + 1) * SPLIT_BLOCKS)
        if COUNT:  # (the block-read counter of the tests; compiled out otherwise)
            tl.atomic_add(COUNTER, tl.maximum(hi - lo, 0))
        heads = g * GROUP + tl.arange(0, GROUP_P)
        head_ok = tl.arange(0, GROUP_P) < GROUP
        d = tl.arange(0, HD_P)
        d_ok = d < HD
        q = tl.load(
            Q + r[:, None, None] * stride_qn + heads[None, :, None] * stride_qh + d[None, None, :],
            mask=row_ok[:, None, None] & head_ok[None, :, None] & d_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        m = tl.full([ROWS, GROUP_P], float("-inf"), tl.float32)
        ls = tl.zeros([ROWS, GROUP_P], tl.float32)
        acc = tl.zeros([ROWS, GROUP_P, HD_P], tl.float32)
        base = g * stride_kh
        for b in range(lo, hi):
            v = b * BLOCK + tl.arange(0, BLOCK)
            valid = v[None, :] < total[:, None]  # [ROWS, BLOCK]
            seen = valid & (v[None, :] >= total[:, None] - window)
            # the prefix (virtual position = slot), shared by every row of the tile: one load per
            # block
            pre = v < start
            pre_mask = pre[:, None] & d_ok[None, :]
            pre_at = base + v[:, None] * stride_ks + d[None, :]
            # each row's tail (its ancestors and itself, by depth): its own slots
            own = valid & (v[None, :] >= start)
            slot = tl.load(TAILS + r[:, None] * stride_tn + (v[None, :] - start), mask=own, other=0)
            own_mask = own[:, :, None] & d_ok[None, None, :]
            own_at = base + slot[:, :, None] * stride_ks + d[None, None, :]
            k_pre = tl.load(K + pre_at, mask=pre_mask, other=0.0)
            k_own = tl.load(K + own_at, mask=own_mask, other=0.0)
            # [ROWS, BLOCK, HD_P]
            k = tl.where(pre[None, :, None], k_pre[None, :, :], k_own).to(tl.float32)
            # [ROWS, GROUP_P, BLOCK]
            s = tl.sum(q[:, :, None, :] * k[:, None, :, :], axis=3) * scale
            s = tl.where(seen[:, None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=2))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, :, None])
            ls = ls * alpha + tl.sum(p, axis=2)
            v_pre = tl.load(V + pre_at, mask=pre_mask, other=0.0)
            v_own = tl.load(V + own_at, mask=own_mask, other=0.0)
            vv = tl.where(pre[None, :, None], v_pre[None, :, :], v_own).to(tl.float32)
            acc = acc * alpha[:, :, None] + tl.sum(p[:, :, :, None] * vv[:, None, :, :], axis=2)
            m = m_new
        at = (r[:, None] * heads_total + heads[None, :]) * splits + split  # [ROWS, GROUP_P]
        ok = row_ok[:, None] & head_ok[None, :]
        tl.store(M_PART + at, m, mask=ok)
        tl.store(L_PART + at, ls, mask=ok)
        tl.store(
            ACC_PART + at[:, :, None] * HD + d[None, None, :],
            acc,
            mask=ok[:, :, None] & d_ok[None, None, :],
        )

    @triton.jit
    def _combine_kernel(
        OUT,
        M_PART,
        L_PART,
        ACC_PART,
        START,
        LENS,
        REAL,
        rows,
        heads_total,
        splits,
        stride_on,
        stride_oh,
        window,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HD: tl.constexpr,
        HD_P: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr,
    ):
        """One (row, key-value head): the row's splits merged in order, from the one holding its
        window's first block to its last, a count that is the row's own; pad rows write zeros."""
        row = tl.program_id(0)
        g = tl.program_id(1)
        ok = row < tl.minimum(tl.load(REAL), rows)
        total = tl.where(ok, tl.load(START) + tl.load(LENS + row, mask=ok, other=0), 0)
        s_lo = (tl.maximum(total - window, 0) // BLOCK) // SPLIT_BLOCKS
        s_hi = tl.cdiv(tl.cdiv(total, BLOCK), SPLIT_BLOCKS)
        heads = g * GROUP + tl.arange(0, GROUP_P)
        head_ok = tl.arange(0, GROUP_P) < GROUP
        d = tl.arange(0, HD_P)
        d_ok = d < HD
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        ls = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HD_P], tl.float32)
        for s in range(s_lo, s_hi):
            at = (row * heads_total + heads) * splits + s
            m_s = tl.load(M_PART + at, mask=head_ok, other=float("-inf"))
            l_s = tl.load(L_PART + at, mask=head_ok, other=0.0)
            a_s = tl.load(
                ACC_PART + at[:, None] * HD + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            beta = tl.exp(m_s - m_safe)
            ls = ls * alpha + l_s * beta
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            m = m_new
        out = acc / tl.where(ls > 0, ls, 1.0)[:, None]  # (a pad row: 0 / 1)
        tl.store(
            OUT + row * stride_on + heads[:, None] * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=head_ok[:, None] & d_ok[None, :],
        )


def rows_per_program(group: int) -> int:
    """The rows of one program's tile: QUERY_TILE query heads in all (rows x the key-value head's
    group, at least one row), a function of the model alone, so a row's tile shape never depends on
    the bucket."""
    return max(1, QUERY_TILE // (1 << max(0, group - 1).bit_length()))


def kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    rows: Optional[torch.Tensor] = None,
    *,
    block_n: int = BLOCK_N,
    split_n: int = SPLIT_N,
    tile_rows: Optional[int] = None,
    counter: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The Triton kernel (see `reference` for the arguments); needs `triton_available()`.

    `rows`: the step's real row count (a device tensor; None: every row); rows past it do nothing
    and give zeros. `block_n`, `split_n` (a multiple of `block_n`) and `tile_rows` (default
    `rows_per_program`) are the kernel's shape; a row's bits are a function of them and of its own
    virtual sequence alone. `counter`: an int64 tensor [1] the kernel adds the key blocks it reads
    to (each block once per program, its prefix part loaded once for the program's rows); the tests'
    measure."""
    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    group = heads // kv
    if split_n % block_n:
        raise ValueError(f"internal: split_n ({split_n}) must be a multiple of block_n ({block_n})")
    q, tails = q.contiguous(), tails.contiguous()
    out = torch.empty_like(q)
    start = torch.as_tensor(start, device=q.device).view(1)
    if rows is None:
        rows = torch.full((1,), n, dtype=torch.long, device=q.device)
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(
            "internal: the tree attention kernel takes contiguous, alike key and value caches"
        )
    shape = _Shape(block_n, split_n // block_n, tile_rows or rows_per_program(group))
    # launched on the tensors' device, not the current one (Triton launches on the current device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _launch(
            q,
            k_cache,
            v_cache,
            out,
            start,
            tails,
            lens,
            rows.view(1),
            scale,
            window,
            shape,
            counter,
        )
    return out.reshape(n, heads * hd)


class _Shape(NamedTuple):
    """The kernel's shape: keys per block, blocks per split, rows per program."""

    block: int
    split_blocks: int
    tile_rows: int


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    start: torch.Tensor,
    tails: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    window: Optional[int],
    shape: _Shape,
    counter: Optional[torch.Tensor],
) -> None:
    """The two launches: the splits over the (row tile, key-value head, split) grid, then their
    combine over (row, key-value head). The split count is the cache's (a fixed shape, graphable);
    splits past a tile's rows exit at once."""
    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    group = heads // kv
    splits = triton.cdiv(triton.cdiv(k_cache.shape[1], shape.block), shape.split_blocks)
    m_part = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(n, heads, splits, hd, dtype=torch.float32, device=q.device)
    win = window if window is not None else 2**31 - 1
    common = dict(
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HD=hd, HD_P=triton.next_power_of_2(hd)
    )
    _split_kernel[(triton.cdiv(n, shape.tile_rows), kv, splits)](
        q,
        k_cache,
        v_cache,
        m_part,
        l_part,
        acc_part,
        start,
        tails,
        lens,
        rows,
        counter if counter is not None else rows,
        float(scale),
        n,
        heads,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        tails.stride(0),
        win,
        BLOCK=shape.block,
        SPLIT_BLOCKS=shape.split_blocks,
        ROWS=shape.tile_rows,
        COUNT=counter is not None,
        # (the tile's [rows, group, block, head_dim] products are 4x the one-row kernel's: twice its
        # warps; untuned, no GPU has timed it)
        num_warps=8,
        **common,
    )
    _combine_kernel[(n, kv)](
        out,
        m_part,
        l_part,
        acc_part,
        start,
        lens,
        rows,
        n,
        heads,
        splits,
        out.stride(0),
        out.stride(1),
        win,
        BLOCK=shape.block,
        SPLIT_BLOCKS=shape.split_blocks,
        **common,
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
    rows: Optional[torch.Tensor],
) -> torch.Tensor:
    """The kernel as one opaque op (window -1: none): fake tensors and torch.compile see its shape
    alone."""
    return kernel(
        q, k_cache, v_cache, start, tails, lens, scale, None if window < 0 else window, rows
    )


@_tree_attention_op.register_fake
def _(q, k_cache, v_cache, start, tails, lens, scale, window, rows):  # noqa: ANN001, ANN202
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
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Row-exact tree attention: the Triton kernel on CUDA (or, with `interpret`, in the interpreter
    on CPU tensors), else the torch reference. Arguments and result as `reference` (`blocks` serves
    the reference
    alone: the kernel stops at each row's own length); `rows`: the step's real row count, a device
        tensor
    (None: every row), past which rows do nothing and give zeros."""
    if triton_available() and (q.is_cuda or interpret):
        win = -1 if window is None else int(window)
        return torch.ops.headway.tree_attention(
            q, k_cache, v_cache, start, tails, lens, float(scale), win, rows
        )
    return reference(
        q, k_cache, v_cache, start, tails, lens, scale, blocks=blocks, window=window, rows=rows
    )
