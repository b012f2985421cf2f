"""EAGLE-2's expansion on the device, for the CUDA backend's loop: the tree `EagleDrafter.draft`
builds on the host (the same nodes, in the same order, with the same parents), from tensors alone,
with no host read, as one CUDA graph on CUDA.

Every size is fixed by (top_k, depth, total_tokens) and the reserved drafter cache: each level
expands exactly top_k rows, so candidate c's parent, depth and drafter slot follow from tensors of
static shape, and the drafter's attention spans its whole reserved cache under a mask built on the
device from the committed length (a device buffer, like the root and the drafter's last output). The
host's tie rules are kept by stable
sorts: the best `total_tokens` candidates by (-score, depth, index); each chosen node's rank among
    its chosen
siblings by (-score, index); the tree's node order by (depth, path) as `build_tree` orders paths.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from headway.heads.draft_layer import drafter_mask
from headway.inference.engines.cuda.graphs import StepGraphs
from headway.inference.engines.static.row_select import top_logprobs


def lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """The order sorting by keys[0], then keys[1], ... (ties: lower index first), by stable sorts
    from the last key to the first."""
    order = torch.arange(keys[0].shape[0], device=keys[0].device)
    for key in reversed(keys):
        order = order.index_select(0, torch.sort(key.index_select(0, order), stable=True).indices)
    return order


class EagleExpansion:
    """The expansion of one drafter as a fixed-shape step over persistent buffers (the root, the
    committed length, the drafter's last output), over the drafter cache reserved at `capacity`
    slots: on CUDA one graph, captured after warm-up (engine_graphs.StepGraphs), replayed for every
        tree.

    Args:
        drafter: the EagleDrafter (its cache a StaticLayerCache); capacity: the slots to reserve, at
            least the longest sequence plus (depth - 1) * top_k expansion slots; graphs: None = on
            CUDA."""

    def __init__(self, drafter: Any, capacity: int, graphs: Optional[bool] = None):
        # the drafter owns its expansion: held by a weak proxy (and the step by a weak method), so
        # the two form no cycle and an expansion's graph goes with its drafter, not at a later
        # collection
        self.drafter = drafter if isinstance(drafter, weakref.ProxyType) else weakref.proxy(drafter)
        p = drafter.param
        self.cache = drafter.cache
        self.cache.reserve(capacity, p.new_zeros(1))
        self.root = torch.zeros(1, dtype=torch.long, device=p.device)
        self.committed = torch.zeros((), dtype=torch.long, device=p.device)
        self.last_out = p.new_zeros(drafter.last_out.shape)
        self.graphs = StepGraphs(self._expand_step, p.device, enabled=graphs)

    def run(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree after `root` [1] (device): node ids and parents (see `expand`)."""
        self.root.copy_(root.view(1))
        self.committed.fill_(self.drafter.committed)
        self.last_out.copy_(self.drafter.last_out)
        return self.graphs.run(0)

    def _expand_step(self, _: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._expand()

    def _expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        drafter, cache = self.drafter, self.cache
        heads, dev, k = drafter.heads, self.root.device, drafter.top_k
        committed, width = self.committed, cache.k.shape[1]
        cols = torch.arange(width, device=dev)
        values, indices = top_logprobs(heads.logits(self.last_out.view(1, -1)), k)
        tokens, scores = [indices[0]], [values[0]]
        parents = [torch.full((k,), -1, dtype=torch.long, device=dev)]
        depths = [torch.ones(k, dtype=torch.long, device=dev)]
        layer = torch.arange(k, device=dev)  # candidate index of each row to expand next
        layer_hidden = heads.next_hidden(self.last_out).view(1, 1, -1).expand(1, k, -1)
        # each row's ancestors' expansion slots
        anc = torch.empty(k, 0, dtype=torch.long, device=dev)
        rows = torch.arange(k, device=dev)
        count = k
        try:
            for d in range(1, drafter.depth):
                anc = torch.cat((anc, ((d - 1) * k + rows).view(k, 1)), 1)
                # each row sees the committed prefix, its own slot and its ancestors' slots
                allowed = (cols[None, :] < committed) | (
                    cols[None, None, :] == (committed + anc)[:, :, None]
                ).any(1)
                cache.at = committed + (d - 1) * k + rows
                ids = heads.to_target_ids(torch.cat(tokens).index_select(0, layer)).view(1, -1)
                pos = (committed + d - 1).expand(1, k)
                out = heads(
                    ids, layer_hidden, pos, drafter_mask(allowed[None], self.last_out.dtype), cache
                )
                child_logp, child_ids = top_logprobs(heads.logits(out[0]), k)
                cum = (
                    torch.cat(scores).index_select(0, layer).unsqueeze(-1) + child_logp
                ).flatten()
                tokens.append(child_ids.flatten())
                scores.append(cum)
                parents.append(layer.repeat_interleave(k))
                depths.append(torch.full((k * k,), d + 1, dtype=torch.long, device=dev))
                best = cum.topk(k).indices
                layer = count + best
                count += k * k
                anc = anc.index_select(0, best // k)
                layer_hidden = heads.next_hidden(out[0].index_select(0, best // k)).unsqueeze(0)
        finally:
            cache.at = None
        return _select(
            drafter,
            self.root,
            torch.cat(tokens),
            torch.cat(scores),
            torch.cat(parents),
            torch.cat(depths),
        )


def _select(
    drafter: Any,
    root: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`EagleDrafter._select` on tensors: the best total_tokens candidates as a tree in build_tree's
    order."""
    dev, k = tokens.device, drafter.top_k
    total, depth = drafter.total_tokens, drafter.depth
    c = tokens.shape[0]
    idx = torch.arange(c, device=dev)
    chosen = lexsort(-scores, depths, idx)[:total]
    is_chosen = torch.zeros(c, dtype=torch.bool, device=dev).index_fill_(0, chosen, True)
    # rank among chosen siblings by (-score, index): siblings share a depth; the root's children are
    # one group
    order = lexsort(parents, -scores, idx)
    p_sorted = parents.index_select(0, order)
    chosen_sorted = is_chosen.index_select(0, order).long()
    # chosen siblings before each entry within its parent's group: a running count reset at each
    # group
    run = torch.cumsum(chosen_sorted, 0) - chosen_sorted
    group_start = torch.ones(c, dtype=torch.bool, device=dev)
    group_start[1:] = p_sorted[1:] != p_sorted[:-1]
    starts = torch.cummax(torch.where(group_start, idx, torch.zeros_like(idx)), 0).values
    rank_sorted = run - run.index_select(0, starts)
    rank = torch.empty_like(rank_sorted).index_copy_(0, order, rank_sorted)
    # a candidate's path as one number: its rank at depth l in digit l (base k, depth digits), so
    # that (depth, path) orders nodes as build_tree orders paths
    key = torch.zeros(c, dtype=torch.long, device=dev)
    cur = idx
    for _ in range(depth):
        valid = cur >= 0
        safe = cur.clamp(min=0)
        digit = torch.where(valid, rank.index_select(0, safe) + 1, torch.zeros_like(idx))
        shift = torch.where(valid, depths.index_select(0, safe) - 1, torch.zeros_like(idx))
        key = key + digit * (k + 1) ** (depth - 1 - shift)
        cur = torch.where(valid, parents.index_select(0, safe), cur)
    sel_depth, sel_key = depths.index_select(0, chosen), key.index_select(0, chosen)
    node_order = chosen.index_select(0, lexsort(sel_depth, sel_key))
    # parents as tree node indices: the root is 0, node i + 1 is node_order[i]
    where = torch.full((c,), -1, dtype=torch.long, device=dev).index_copy_(
        0, node_order, torch.arange(1, total + 1, device=dev)
    )
    par = parents.index_select(0, node_order)
    tree_parent = torch.where(
        par >= 0, where.index_select(0, par.clamp(min=0)), torch.zeros_like(par)
    )
    ids = drafter.heads.to_target_ids(tokens.index_select(0, node_order))
    minus = torch.full((1,), -1, dtype=torch.long, device=dev)
    return torch.cat((root.view(1), ids)), torch.cat((minus, tree_parent))
