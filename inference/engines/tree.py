"""Draft trees: which candidate tokens are verified together, and the attention that keeps paths
apart.

A tree is given as choices (Medusa's notation): each node is a path of top-k indices, one per depth,
so (0, 1) is "the best guess at depth 1, then the second-best guess at depth 2". Node 0 is the root,
the token the target has just produced; every other node is verified in the same target forward,
attending only to the prefix and to its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headway.errors import HeadwayError


@dataclass
class Tree:
    paths: list[tuple[int, ...]]  # node i's path; paths[0] == () is the root
    parent: list[int]  # parent node of each node (-1 for the root)
    children: list[list[int]]  # child nodes of each node, in order of top-k rank
    depth: torch.Tensor  # [n] depth of each node (root 0)
    ancestors: torch.Tensor  # [n, n] bool: node i may attend to node j (j is i or an ancestor of i)

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def topk_per_depth(self) -> list[int]:
        """How many ranked guesses each depth needs (the largest index used there, plus one)."""
        ks = [0] * self.max_depth
        for p in self.paths[1:]:
            ks[len(p) - 1] = max(ks[len(p) - 1], p[-1] + 1)
        return ks


def build_tree(choices: list[list[int]] | list[tuple[int, ...]]) -> Tree:
    """A tree from Medusa choices; every prefix of a path must itself be a node."""
    paths = sorted(
        {tuple(int(x) for x in c) for c in choices if len(c) > 0}, key=lambda p: (len(p), p)
    )
    index = {(): 0}
    for p in paths:
        if p[:-1] not in index:
            raise HeadwayError(
                f"tree choice {list(p)} has no parent {list(p[:-1])}: every prefix of a path must be a node"
            )
        if any(x < 0 for x in p):
            raise HeadwayError(f"tree choice {list(p)} has a negative top-k index")
        index[p] = len(index)
    all_paths = [()] + paths
    parent = [-1] + [index[p[:-1]] for p in paths]
    children: list[list[int]] = [[] for _ in all_paths]
    for i, p in enumerate(all_paths[1:], start=1):
        children[parent[i]].append(i)
    n = len(all_paths)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    depth = torch.tensor([len(p) for p in all_paths])
    return Tree(all_paths, parent, children, depth, anc)


def chain_choices(depth: int) -> list[list[int]]:
    """A single path: the best guess of each head (Medusa/EAGLE without branching)."""
    return [[0] * d for d in range(1, depth + 1)]


def tree_attention_bias(
    tree: Tree, prefix_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive 4-D mask [1, 1, n, prefix_len + n]: 0 where a node may attend, the dtype's
    minimum elsewhere."""
    n = tree.size
    bias = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=device)
    bias[0, 0, :, prefix_len:].masked_fill_(~tree.ancestors.to(device), torch.finfo(dtype).min)
    return bias


def best_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[list[int]]:
    """The `num_nodes` paths with the highest estimated acceptance, as Medusa builds its sparse
    trees.

    rank_accuracy[d][k] is how often head d's rank-k guess was the right token (measured on held-out
    data). A path's value is the product along it, its chance of being accepted if heads err
    independently; the expected accepted length is the sum of the values of the chosen nodes, and
    the top-N paths by value always form a valid tree because a child's value never exceeds its
    parent's.
    """
    import heapq

    frontier: list[tuple[float, tuple[int, ...]]] = [
        (-rank_accuracy[0][k], (k,)) for k in range(len(rank_accuracy[0]))
    ]
    heapq.heapify(frontier)
    chosen: list[list[int]] = []
    while frontier and len(chosen) < num_nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(list(path))
        depth = len(path)
        if depth < len(rank_accuracy):
            for k, acc in enumerate(rank_accuracy[depth]):
                heapq.heappush(frontier, (neg * acc, path + (k,)))
    return chosen


def tree_from_parents(parents: list[int]) -> tuple[Tree, list[int]]:
    """The tree over candidates given by their parent candidate (-1: the root), and which candidate
    each tree node after the root is. Siblings keep the candidates' order (best first if the caller
    sorted them); every parent must be a candidate too."""
    paths: dict[int, tuple[int, ...]] = {}
    taken: dict[int, int] = {}  # parent -> children placed so far

    def path(c: int) -> tuple[int, ...]:
        if c not in paths:
            p = parents[c]
            prefix = () if p < 0 else path(p)
            paths[c] = prefix + (taken.get(p, 0),)
            taken[p] = taken.get(p, 0) + 1
        return paths[c]

    for c in range(len(parents)):
        path(c)
    tree = build_tree(list(paths.values()))
    by_path = {p: c for c, p in paths.items()}
    return tree, [by_path[p] for p in tree.paths[1:]]
