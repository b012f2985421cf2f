"""Medusa drafting: the heads' top-k guesses, placed on the nodes of a static tree."""

from __future__ import annotations

import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaHeads
from headway.inference.tree import Tree


class MedusaDrafter:
    """Fills a static tree from the heads' guesses on the hidden state that produced the root token."""

    def __init__(self, heads: MedusaHeads, tree: Tree, num_target_layers: int):
        if tree.max_depth > heads.cfg.num_heads:
            raise HeadwayError(
                f"the tree is {tree.max_depth} deep but the head has only {heads.cfg.num_heads} Medusa heads: "
                "use a shallower inference.tree, or inference.tree_nodes=N to build one from the head's accuracy"
            )
        self.heads = heads
        self.tree = tree
        self.max_nodes = tree.size
        self.feature_layers = heads.feature_layers(heads.cfg, num_target_layers)
        self.ks = tree.topk_per_depth()
        self.kmax = max(self.ks)
        self.node_depth = (tree.depth[1:] - 1).tolist()
        self.node_rank = [p[-1] for p in tree.paths[1:]]
        self.hidden: torch.Tensor | None = None

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    def settings(self) -> dict:
        return {"drafter": "neural", "kind": "medusa", "tree": [list(p) for p in self.tree.paths[1:]]}

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        self.hidden = features[-1]

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        self.hidden = features[-1]

    @torch.no_grad()
    def proposals(self, root: int) -> tuple[list[int], list[float], list[int]]:
        """The static tree's nodes for a hybrid tree: target token id, its head's probability (Medusa heads guess
        each depth independently), and parent node (-1: the root; parents come first)."""
        depth = len(self.ks)
        logits = self.heads(self.hidden.view(1, -1).to(next(self.heads.parameters()).dtype))[:depth, 0]
        top = torch.topk(torch.softmax(logits.float(), -1), self.kmax, dim=-1)
        ids = self.heads.to_target_ids(top.indices)[self.node_depth, self.node_rank].tolist()
        probs = top.values[self.node_depth, self.node_rank].tolist()
        return ids, probs, [p - 1 for p in self.tree.parent[1:]]

    @torch.no_grad()
    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        """Token ids of every tree node (root first), from the last hidden state that the target produced."""
        depth = len(self.ks)
        logits = self.heads(self.hidden.view(1, -1).to(next(self.heads.parameters()).dtype))[:depth, 0]
        top = self.heads.to_target_ids(torch.topk(logits, self.kmax, dim=-1).indices)
        nodes = top[self.node_depth, self.node_rank]
        return torch.cat([torch.tensor([root], device=nodes.device), nodes]), self.tree
