"""Tree bookkeeping on the device, for the CUDA backend's step: a tree's ancestors and depths from
its parent array, and greedy acceptance, with static shapes and no host read.

A tree arrives as parent indices [M] (-1: the root, and every pad row past the tree's `n` nodes),
nodes in an order where a parent comes before its children and siblings are in rank order (what
`build_tree` and the drafters give). Greedy acceptance here picks exactly the path
`sampling.accept_greedy` walks: at each node the first child (lowest index) whose token is the
target's argmax there.
"""

from __future__ import annotations

import math

import torch


def tree_ancestors(parent: torch.Tensor) -> torch.Tensor:
    """[M, M] bool: node i may attend to node j (j is i or one of its ancestors), by repeated
    squaring of the parent relation (ceil(log2 M) products of 0/1 matrices, exact in float32: no sum
    exceeds M).

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
    tokens: torch.Tensor,
    parent: torch.Tensor,
    ancestors: torch.Tensor,
    argmax: torch.Tensor,
    n: torch.Tensor,
) -> torch.Tensor:
    """The greedy walk of a verified tree, on the device.

    Args:
        tokens: [M] node token ids (root first); parent: [M] (-1: root and pads); ancestors:
            `tree_ancestors`;
        argmax: [M] the target's first-max token after each node; n: 0-d, the real node count (rows
            >= n are
        padding).
    Returns:
        [2 + M] int64: the accepted draft count a, the bonus token (the argmax after the path), then
        the path's node indices by depth (root first; entries past a + 1 are other nodes, to be
        ignored)."""
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


def sample_accept(
    tokens: torch.Tensor,
    parent: torch.Tensor,
    ancestors: torch.Tensor,
    probs: torch.Tensor,
    uniforms: torch.Tensor,
    n: torch.Tensor,
) -> torch.Tensor:
    """Tree rejection sampling on the device (`sampling.accept_exact`'s rule, lossless), with its
    uniforms drawn ahead of the step.

    At a node, the children are tried in order: child c is accepted with probability p(x_c) / (1 -
    S_c), its parent's target probability of its token over the mass its earlier siblings'
    (distinct) tokens left; a token an earlier sibling already tried is never accepted. Each node's
    test uses its own uniform, so the first accepted child has the host's sequential distribution;
    the walk follows first accepted children, and where it ends the next token is sampled from that
    node's residual (its children's tokens removed).

    Args:
        tokens, parent, ancestors, n: as `greedy_accept`; probs: [M, V] the target's distribution
            after each
        node (`distribution.target_distribution`); uniforms: [M + 1] in [0, 1): one per node, then
        the last one for the bonus token.
    Returns:
        [2 + M] int64, as `greedy_accept`'s."""
    m = tokens.shape[0]
    r = torch.arange(m, device=tokens.device)
    real = r < n
    has_parent = (parent >= 0) & real
    par = parent.clamp(min=0)
    p_tok = probs[par, tokens]
    earlier = (parent[None, :] == parent[:, None]) & (r[None, :] < r[:, None]) & has_parent[None, :]
    repeat = (earlier & (tokens[None, :] == tokens[:, None])).any(1)
    removed = ((earlier & ~repeat[None, :]).to(probs.dtype) * p_tok[None, :]).sum(1)
    left = (1 - removed).clamp_min(torch.finfo(probs.dtype).tiny)
    accept = has_parent & ~repeat & (uniforms[:m].to(probs.dtype) < p_tok / left)
    chosen = (accept & ~(earlier & accept[None, :]).any(1)) | (r == 0)
    on_walk = ~(ancestors & ~chosen[None, :]).any(1) & real
    depth = ancestors.sum(1) - 1
    path = torch.sort(torch.where(on_walk, depth, m + r), stable=True).indices
    accepted = on_walk.sum() - 1
    last = path.gather(0, accepted.view(1))
    # the residual where the walk ended: its children's tokens (all rejected) removed
    kids = (parent == last) & real
    gone = torch.zeros(probs.shape[1], dtype=torch.long, device=tokens.device)
    gone = gone.scatter_reduce(0, tokens, kids.long(), "amax")
    residual = torch.where(gone.bool(), torch.zeros_like(probs[0]), probs.index_select(0, last)[0])
    cumulative = residual.cumsum(0)
    target = uniforms[m:].to(probs.dtype) * cumulative[-1:]
    bonus = torch.searchsorted(cumulative, target, right=True).clamp(max=probs.shape[1] - 1)
    return torch.cat((accepted.view(1), bonus, path))
