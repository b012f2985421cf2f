"""Attention plans of the CPU backend: which slots each query row of a step attends to, and how.

`RowAttention` gives every row of a tree exactly a one-token step's arithmetic (bf16/fp16 on CPUs,
where the fused attention kernel's bits depend on the query count); `TransposedKeys` is its C++
kernel's transposed key blocks. The CUDA backend's plan is its device tree (engines/cuda/runner.py),
built from persistent buffers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


def _row_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: "RowAttention",
    scale: float,
) -> torch.Tensor:
    """RowAttention's computation over q [n, heads, head_dim] -> [n, heads * head_dim]: the C++
    kernel (`plan.kernel`), or SDPA: rows `plan.order`, group after group, attend to their slots
    (read in place, or gathered into `plan.slots` in that order)."""
    if plan.kernel is not None:
        kt = None if plan.transposed is None else plan.transposed.of(k_cache)
        return plan.kernel(
            q, k_cache, v_cache, plan.start, plan.tails, plan.lens, scale, kt, plan.kt_valid
        )
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    # in float32: the CPU's fused attention is much faster there than in bf16 for one query
    # (docs/inference.md); the row-exact runners keep their cache in float32, so that no step
    # converts it
    if plan.slots is not None:
        k_all, v_all = (
            k_cache.index_select(1, plan.slots).float(),
            v_cache.index_select(1, plan.slots).float(),
        )
    q_all = (
        (q if plan.in_order else q.index_select(0, plan.order)).unsqueeze(2).float()
    )  # [rows, heads, 1, head_dim]
    outs, slot, row = [], 0, 0
    for b, length, in_place in plan.groups:
        if in_place:
            k, v = k_cache[None, :, :length].float(), v_cache[None, :, :length].float()
        else:
            k = (
                k_all[:, slot : slot + b * length]
                .view(kv_heads, b, length, head_dim)
                .transpose(0, 1)
            )
            v = (
                v_all[:, slot : slot + b * length]
                .view(kv_heads, b, length, head_dim)
                .transpose(0, 1)
            )
            slot += b * length
        outs.append(
            F.scaled_dot_product_attention(q_all[row : row + b], k, v, scale=scale, enable_gqa=True)
        )
        row += b
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(q.shape[0], -1)
    if not plan.in_order:
        out = torch.empty_like(out).index_copy_(0, plan.order, out)
    return out.to(q.dtype)


# Under torch.compile RowAttention is one opaque op that reads the step's plan (its rows, slots and
# groups) from here, set by the runner around the compiled call: as graph inputs or structure, the
# plan's sizes would compile a graph for each tree shape.
_ACTIVE: list[Optional["RowAttention"]] = [None]


@torch.library.custom_op("headway::row_attention", mutates_args=())
def _row_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    plan = _ACTIVE[0]
    if plan is None:
        raise RuntimeError("internal: a compiled row-exact step ran without its RowAttention plan")
    return _row_attention(q, k_cache, v_cache, plan, scale)


@_row_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class RowAttention:
    """Attention that gives each query row exactly what a one-token decoding step of that token
    would: row i attends to the cache's first `start` slots and then `tails[i]` (its ancestors and
        itself, by depth), as a
    sequence of its own, with no mask. In bf16 the fused attention kernel's result for a row depends
    on the query count, the mask and the key length; after bf16 rounding that flips near-ties, so
    speculative and plain decoding part ways.

    Two implementations, one per runner (never mixed within a decode): `kernel`, Headway's C++
    kernel (csrc/row_attention.cpp), whose every row's arithmetic is fixed whatever the other rows,
    so a tree costs about its rows' share of one pass over the cache; or (kernel None) SDPA per row:
    a row whose slots are the cache's first ones in order (plain decoding's row, every row of a
    chain) reads the cache in place, the others are gathered, rows of one length in one call. Either
    way the row's computation is plain decoding's."""

    def __init__(
        self,
        start: int,
        tails: list[list[int]],
        device: torch.device,
        kernel: Optional[Any] = None,
        transposed: Optional[TransposedKeys] = None,
    ):
        self.start, self.kernel = start, kernel
        # the kernel's transposed key blocks (None: it transposes the prefix afresh) and how many
        # slots are current
        self.transposed = transposed
        self.kt_valid = 0 if transposed is None else transposed.valid
        if kernel is not None:
            # rows past the first that repeat it (a one-token step's padding) are copies: computed
            # once
            real = len(tails)
            while real > 1 and tails[real - 1] == tails[0]:
                real -= 1
            width = max(len(t) for t in tails[:real])
            self.tails = torch.tensor(
                [t + [0] * (width - len(t)) for t in tails[:real]], device=device
            )
            self.lens = torch.tensor([len(t) for t in tails[:real]], device=device)
            self.order, self.in_order, self.groups, self.slots = torch.empty(0), True, [], None
            return
        self.tails = self.lens = torch.empty(0)
        in_place: list[int] = []
        by_len: dict[int, list[int]] = {}
        for i, tail in enumerate(tails):
            if tail == list(range(start, start + len(tail))):
                in_place.append(i)
            else:
                by_len.setdefault(len(tail), []).append(i)
        # groups in order: each in-place row alone, then each length's gathered rows, their slots
        # gathered in one call
        order = in_place + [i for rows in by_len.values() for i in rows]
        self.order = torch.tensor(order, device=device)
        self.in_order = order == list(range(len(order)))
        self.groups = [(1, start + len(tails[i]), True) for i in in_place] + [
            (len(rows), start + length, False) for length, rows in by_len.items()
        ]
        self.slots = None
        if by_len:  # tensor ops, not Python lists: the plan's cost must not grow with the sequence
            prefix = torch.arange(start, device=device)
            self.slots = torch.cat(
                [
                    torch.cat(
                        (
                            prefix.expand(len(rows), start),
                            torch.tensor([tails[i] for i in rows], device=device),
                        ),
                        dim=1,
                    ).view(-1)
                    for rows in by_len.values()
                ]
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [n, heads, head_dim] (rotated) -> [n, heads * head_dim], in q's dtype."""
        # the plan is _ACTIVE's at run time (StaticRunner._row_exact)
        if torch.compiler.is_compiling():
            return torch.ops.headway.row_attention(q, k_cache, v_cache, scale)
        return _row_attention(q, k_cache, v_cache, self, scale)


class TransposedKeys:
    """The row attention kernel's copy of each layer's key cache in blocks of 16 keys, transposed
    (per layer [kv_heads, ceil(max_len / 16), head_dim rounded up to 4, 16], float32), and how many
    leading slots it holds current (`valid`). The kernel fills in the blocks it transposes, so a
    one-token step transposes only the newest block, not the whole prefix; every write to a key slot
    below `valid` (`written`) makes the blocks
    from there
    on stale."""

    def __init__(self, keys: list[torch.Tensor]):
        kv_heads, max_len, head_dim = keys[0].shape
        shape = (kv_heads, -(-max_len // 16), -(-head_dim // 4) * 4, 16)
        self.buffers = [torch.zeros(shape, dtype=torch.float32, device=k.device) for k in keys]
        self.keys = keys
        self._by_keys = {k.data_ptr(): b for k, b in zip(keys, self.buffers)}
        self.valid = 0

    def of(self, k_cache: torch.Tensor) -> torch.Tensor:
        """The transposed blocks of this layer's key cache."""
        return self._by_keys[k_cache.data_ptr()]

    def written(self, slot: int) -> None:
        """Key slots from `slot` on are (re)written."""
        self.valid = min(self.valid, slot)
