"""Static-tree drafting, shared by the kinds that guess each position ahead of the root
independently (Medusa's heads, DFlash's block slots): the guesses' top-k ranks are placed on the
    nodes of a static tree,
which the target verifies in one forward; `tree_search.StaticTrees` tunes its shape."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.inference.config import DEFAULT_STATIC_TREE
from headway.inference.engines.tree import Tree, best_tree, build_tree


def choose_tree(ic: Any, head_config: dict, default: list[list[int]]) -> list[list[int]]:
    """inference.tree (`default` when null), or the best tree of `inference.tree_nodes` nodes from
    the head's calibration.

    Args:
        ic: the InferenceConfig; head_config: the head's config.json (its rank_accuracy); default:
            the kind's tree.
    Returns:
        The tree's nodes, each a path of per-position ranks."""
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


class StaticTreeDrafter(ABC):
    """Fills a static tree from a head's guesses for each position ahead of the root.

    A subclass says how its head guesses (`offset_logits`), what it keeps between steps (`begin`,
    `accept`) and, where it has one, its own default tree (`default_tree`)."""

    # draft_tensors: the static tree's guesses on the device (generate.Drafter)
    drafts_on_device = True
    node_sources = None
    expands_levels = False  # one forward guesses every position: no depth to choose

    @classmethod
    def default_tree(cls, heads: Any) -> list[list[int]]:
        """The tree inference.tree=null means for this kind: DEFAULT_STATIC_TREE unless a subclass
        has its own."""
        return DEFAULT_STATIC_TREE

    @classmethod
    def from_config(
        cls, heads: Any, ic: Any, head_config: dict, num_target_layers: int, options: Any = None
    ) -> "StaticTreeDrafter":
        """The drafter the inference section asks for (`ic`: InferenceConfig, its tree / tree_nodes;
        head_config: the head's config.json). `options` (the engine settings) is not needed: a
            static tree's
        guesses come from the heads' own forward, which runs no layer of the target's engine."""
        return cls(
            heads,
            build_tree(choose_tree(ic, head_config, cls.default_tree(heads))),
            num_target_layers,
        )

    def __init__(self, heads: Any, tree: Tree, num_target_layers: int):
        """Args:
        heads: the head (its draft_depth, feature_layers, to_target_ids); tree: the static tree it
            fills;
        num_target_layers: the target's decoder layers (for the features the head reads)."""
        if tree.max_depth > heads.draft_depth:
            raise HeadwayError(
                f"the tree is {tree.max_depth} deep but the head drafts only {heads.draft_depth} tokens "
                "ahead: use a shallower inference.tree, or inference.tree_nodes=N to build one from the "
                "head's accuracy"
            )
        self.heads = heads
        self.tree = tree
        self.max_nodes = tree.size
        self.feature_layers = heads.feature_layers(heads.cfg, num_target_layers)
        self.ks = tree.topk_per_depth()
        self.kmax = max(self.ks)
        self.node_depth = (tree.depth[1:] - 1).tolist()
        self.node_rank = [p[-1] for p in tree.paths[1:]]
        self._on_device: dict = {}  # device -> (node depth, node rank, parent) as device tensors

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    def settings(self) -> dict:
        return {
            "drafter": "neural",
            "kind": self.heads.kind,
            "tree": [list(p) for p in self.tree.paths[1:]],
        }

    @abstractmethod
    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        """Start a request: features [n, F] of the prompt's positions, root the first token the
        target chose."""

    @abstractmethod
    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        """After a verification: the features of the verified positions; tokens end with the new
        root."""

    @abstractmethod
    def offset_logits(self, root: int) -> torch.Tensor:
        """[tree depth, draft vocab]: the head's logits for the token d + 1 positions after the
        root."""

    @torch.no_grad()
    def proposals(self, root: int) -> tuple[list[int], list[float], list[int]]:
        """The static tree's nodes for a hybrid tree: target token id, its head's probability (each
        depth is guessed independently), and parent node (-1: the root; parents come first)."""
        top = torch.topk(torch.softmax(self.offset_logits(root).float(), -1), self.kmax, dim=-1)
        ids = self.heads.to_target_ids(top.indices)[self.node_depth, self.node_rank].tolist()
        probs = top.values[self.node_depth, self.node_rank].tolist()
        return ids, probs, [p - 1 for p in self.tree.parent[1:]]

    @torch.no_grad()
    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        """Token ids of every tree node (root first), from the head's guesses for each position."""
        top = self.heads.to_target_ids(
            torch.topk(self.offset_logits(root), self.kmax, dim=-1).indices
        )
        nodes = top[self.node_depth, self.node_rank]
        return torch.cat([torch.tensor([root], device=nodes.device), nodes]), self.tree

    def reserve(self, max_len: int, graphs: Optional[bool] = None) -> None:
        """Nothing to size: a static tree's drafting keeps no cache of its own
        (cuda/loop.DeviceDrafter)."""

    @torch.no_grad()
    def draft_tensors(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` on the device, for the CUDA backend's loop: root [1] (a device tensor) -> the
        tree's node ids [n] and parent indices [n] (-1: the root), without a host read; the tree's
        indices are uploaded once."""
        device = root.device
        if device not in self._on_device:
            self._on_device[device] = tuple(
                torch.tensor(x, dtype=torch.long, device=device)
                for x in (self.node_depth, self.node_rank, self.tree.parent)
            )
        depth, rank, parent = self._on_device[device]
        top = self.heads.to_target_ids(
            torch.topk(self.offset_logits(root), self.kmax, dim=-1).indices
        )
        return torch.cat([root.view(1), top[depth, rank]]), parent
