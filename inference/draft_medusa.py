"""Medusa drafting: the heads' top-k guesses, placed on the nodes of a static tree."""

from __future__ import annotations

import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaHeads
from headway.inference.tree import Tree


class MedusaDrafter:
    """Fills a static tree from the heads' guesses on the hidden state that produced the root token."""

    def __init__(self, heads: MedusaHeads, tree: Tree):
        if tree.max_depth > heads.cfg.num_heads:
            raise HeadwayError(
                f"the tree is {tree.max_depth} deep but the head has only {heads.cfg.num_heads} Medusa heads: "
                "use a shallower inference.tree, or inference.tree_nodes=N to build one from the head's accuracy"
            )
        self.heads = heads
        self.tree = tree
        self.ks = tree.topk_per_depth()
        self.kmax = max(self.ks)
        self.node_depth = (tree.depth[1:] - 1).tolist()
        self.node_rank = [p[-1] for p in tree.paths[1:]]

    @torch.no_grad()
    def tree_tokens(self, root: int, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids of every tree node (root first) given the target's last hidden state [h]."""
        depth = len(self.ks)
        logits = self.heads(hidden.view(1, -1).to(next(self.heads.parameters()).dtype))[:depth, 0]
        top = self.heads.to_target_ids(torch.topk(logits, self.kmax, dim=-1).indices)
        nodes = top[self.node_depth, self.node_rank]
        return torch.cat([torch.tensor([root], device=nodes.device), nodes])
