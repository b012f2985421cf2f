"""Decoding settings shared by `headway generate` and `headway bench`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from headway.inference.sampling import SamplingConfig


# A small static tree (8 nodes + root) for 4 Medusa heads: on a CPU, verifying many nodes costs more
# than it gains (8 tokens ~1.5x one token, 32 tokens ~2.3x), so the default stays small.
DEFAULT_MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@dataclass
class InferenceConfig:
    # Medusa choices: each node is a path of top-k indices, one per head.
    tree: list[list[int]] = field(default_factory=lambda: [list(c) for c in DEFAULT_MEDUSA_TREE])
    # > 0: build the best tree of this many nodes from the head's measured per-rank accuracy
    # (saved at the end of training), instead of `tree`.
    tree_nodes: int = 0
    # EAGLE-2 dynamic tree (EAGLE heads): drafter steps per tree, children per expanded node, and how
    # many draft nodes (root excluded) the target verifies per forward.
    depth: int = 5
    top_k: int = 8
    total_tokens: int = 15
    max_new_tokens: int = 256
    # Also decode plainly (same engine) and report the speedup and whether the outputs match.
    compare_plain: bool = True
    # System prompt for chat prompts; null = the chat template's default.
    system_prompt: Optional[str] = None
    # Temperature 0 (greedy, the default) or sampling; plain and speculative decoding use the same.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

