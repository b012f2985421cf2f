"""Tree bookkeeping on the device, for the CUDA backend's step: a tree's ancestors and depths from its parent
array, and greedy acceptance, with static shapes and no host read.

A tree arrives as parent indices [M] (-1: the root, and every pad row past the tree's `n` nodes), nodes in
an order where a parent comes before its children and siblings are in rank order (what `build_tree` and the
drafters give). Greedy acceptance here picks exactly the path `sampling.accept_greedy` walks: at each node
the first child (lowest index) whose token is the target's argmax there.
"""

from __future__ import annotations

import math

import torch


def tree_ancestors(parent: torch.Tensor) -> torch.Tensor:
    """[M, M] bool: node i may attend to node j (j is i or one of its ancestors), by repeated squaring of
    the parent relation (ceil(log2 M) products of 0/1 matrices, exact in float32: no sum exceeds M).

    Args:
        parent: [M] int64, -1 for roots (pad rows are roots of their own).
    Returns:
        ancestors [M, M] bool, the diagonal set."""
    m = parent.shape[0]
    r = torch.arange(m, device=parent.device)
    reach = (r[:, None] == r[None, :]) | (parent[:, None] == r[None, :])
    reach = reach.float()
    for _ in range(max(1, math.ceil(math.log2(max(m, 2))))):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


def greedy_accept(
    tokens: torch.Tensor, parent: torch.Tensor, ancestors: torch.Tensor, argmax: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """The greedy walk of a verified tree, on the device.

    Args:
        tokens: [M] node token ids (root first); parent: [M] (-1: root and pads); ancestors: `tree_ancestors`;
        argmax: [M] the target's first-max token after each node; n: 0-d, the real node count (rows >= n are
        padding).
    Returns:
        [2 + M] int64: the accepted draft count a, the bonus token (the argmax after the path), then the
        path's node indices by depth (root first; entries past a + 1 are other nodes, to be ignored)."""
    m = tokens.shape[0]
    r = torch.arange(m, device=tokens.device)
    real = r < n
    has_parent = parent >= 0
    par = parent.clamp(min=0)
    correct = (tokens == argmax[par]) & has_parent & real
    # a correct node is chosen unless an earlier sibling (lower index, same parent) is correct too
    earlier = (parent[None, :] == parent[:, None]) & (r[None, :] < r[:, None]) & correct[None, :]
    chosen = (correct & ~earlier.any(1)) | (r == 0)
    # on the walk: every ancestor (itself included) chosen
    on_walk = ~(ancestors & ~chosen[None, :]).any(1) & real
    depth = ancestors.sum(1) - 1
    key = torch.where(on_walk, depth, m + r)
    path = torch.sort(key, stable=True).indices
    accepted = on_walk.sum() - 1
    last = path.gather(0, accepted.view(1))
    bonus = argmax.gather(0, last)
    return torch.cat((accepted.view(1), bonus, path))
