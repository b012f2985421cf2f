"""What a head kind is to Headway: the one record of it, looked up by the kind's name.

Each stage keeps its part of a kind beside its own code, by the same name: train/objectives
(`OBJECTIVES`), inference/drafters/neural.py (`NEURAL`), inference/tune/spaces.py (`TREE_SPACES`)
and export/layouts (`LAYOUTS`, `REFUSED`); tests/headway/test_structure.py checks every registered
kind has each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


def _unchanged(cfg: Any, num_target_layers: int) -> Any:
    return cfg


def _no_lm_head(head: dict) -> bool:
    return False


def _as_saved(head: dict, state: dict) -> dict:
    return head


@dataclass(frozen=True)
class HeadKind:
    """A head kind: its `head.<name>` config section and module, and what every stage needs to know
    of its heads (each stage's own part of the kind is in that stage's table, by the kind's name).

    Callables, with the arguments each stage passes:
        draft_tokens(saved head section) -> the draft length a serving engine runs the head with.
        for_target(kind config, num target layers) -> the config with its target-dependent defaults
        resolved
            and checked (saved with the head).
        reduced_vocab(kind config) -> whether the head predicts over a draft vocabulary (d2t, built
        from the
            training data's most frequent tokens).
        reads_target_lm_head(saved head section) -> whether an engine export carries the target's
        lm_head. upgrade(saved head section, state) -> the section with the values heads saved
        before a setting
            existed.
    """

    name: str
    title: str  # for messages and docs: "Medusa-1/2", "EAGLE-1/2", "EAGLE-3"
    config: type  # the dataclass of the head.<name> section
    module: type  # the torch module: (cfg, hidden, vocab[, layer_config], d2t=) -> head
    # carries one decoder layer built from the target's config (head.<name>.draft_layer)
    layered: bool
    draft_tokens: Callable[[dict], int]
    for_target: Callable[[Any, int], Any] = _unchanged
    reduced_vocab: Callable[[Any], bool] = lambda cfg: False
    reads_target_lm_head: Callable[[dict], bool] = _no_lm_head
    upgrade: Callable[[dict, dict], dict] = _as_saved
    adapts_target: bool = False  # may train LoRA adapters of the target with it (Medusa-2)
    # may draft in bf16 beside a float32 target (inference.drafter_dtype=auto): every weight its
    # drafting reads is its own (EAGLE-3's read-out is its own lm_head; EAGLE-1's is the target's,
    # which a bf16 draft would copy per call)
    drafts_in_bf16: bool = False

    def build(
        self,
        cfg: Any,
        hidden_size: int,
        vocab_size: int,
        d2t: Optional[torch.Tensor] = None,
        layer_config: Optional[dict] = None,
    ) -> Any:
        """A fresh head module; layered kinds also take the one-layer config of their decoder."""
        if self.layered:
            return self.module(cfg, hidden_size, vocab_size, layer_config, d2t=d2t)
        return self.module(cfg, hidden_size, vocab_size, d2t=d2t)
