"""Static-tree drafting: a head's top-k guesses for each position ahead of the root, placed on the nodes of a
static tree (Medusa's heads; DFlash's block slots subclass it)."""

from __future__ import annotations

from typing import Any

import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaHeads
from headway.inference.config import DEFAULT_MEDUSA_TREE
from headway.inference.tree import Tree, best_tree, build_tree


def choose_tree(ic: Any, head_config: dict, default: list[list[int]]) -> list[list[int]]:
    """inference.tree (`default` when null), or the best tree of `inference.tree_nodes` nodes from the head's
    calibration."""
    n = ic.tree_nodes
    if n <= 0:
        return ic.tree if ic.tree is not None else default
    accuracy = head_config.get("rank_accuracy")
    if not accuracy:
        raise HeadwayError(
            "inference.tree_nodes needs the head's measured accuracy (rank_accuracy in its config.json, "
            "written when training has a held-out split); set inference.tree_nodes=0 to use inference.tree"
        )
    return best_tree(accuracy, n)


class MedusaDrafter:
    """Fills a static tree from the heads' guesses on the hidden state that produced the root token."""

    @classmethod
    def from_config(
        cls, heads: MedusaHeads, ic: Any, head_config: dict, num_target_layers: int
    ) -> "MedusaDrafter":
        """The drafter the inference section asks for (`ic`: InferenceConfig; head_config: the head's config.json)."""
        return cls(heads, build_tree(choose_tree(ic, head_config, DEFAULT_MEDUSA_TREE)), num_target_layers)

    def __init__(self, heads: MedusaHeads, tree: Tree, num_target_layers: int):
        if tree.max_depth > heads.draft_depth:
            raise HeadwayError(
                f"the tree is {tree.max_depth} deep but the head drafts only {heads.draft_depth} tokens ahead: "
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
        return {"drafter": "neural", "kind": self.heads.kind, "tree": [list(p) for p in self.tree.paths[1:]]}

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        self.hidden = features[-1]

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        self.hidden = features[-1]

    def offset_logits(self, root: int) -> torch.Tensor:
        """[tree depth, draft vocab]: the head's logits for the token d + 1 positions after the root, each depth
        guessed independently (Medusa: head d on the last hidden state the target produced)."""
        hidden = self.hidden.view(1, -1).to(next(self.heads.parameters()).dtype)
        return self.heads(hidden)[: len(self.ks), 0]

    @torch.no_grad()
    def proposals(self, root: int) -> tuple[list[int], list[float], list[int]]:
        """The static tree's nodes for a hybrid tree: target token id, its head's probability (Medusa heads guess
        each depth independently), and parent node (-1: the root; parents come first)."""
        top = torch.topk(torch.softmax(self.offset_logits(root).float(), -1), self.kmax, dim=-1)
        ids = self.heads.to_target_ids(top.indices)[self.node_depth, self.node_rank].tolist()
        probs = top.values[self.node_depth, self.node_rank].tolist()
        return ids, probs, [p - 1 for p in self.tree.parent[1:]]

    @torch.no_grad()
    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        """Token ids of every tree node (root first), from the last hidden state that the target produced."""
        top = self.heads.to_target_ids(torch.topk(self.offset_logits(root), self.kmax, dim=-1).indices)
        nodes = top[self.node_depth, self.node_rank]
        return torch.cat([torch.tensor([root], device=nodes.device), nodes]), self.tree
