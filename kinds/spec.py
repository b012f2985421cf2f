"""What a head kind is to Headway: the one record every stage looks up by the kind's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch


class TreeSpace(Protocol):
    """The trees `headway tune` searches for a kind (inference/tree_search.py)."""

    def verify_sizes(self, tc: Any) -> list[int]: ...

    def candidates(
        self,
        heads: Any,
        drafter: Any,
        replays: list,
        cost: Callable[[int, int], float],
        tc: Any,
        num_layers: int,
    ) -> list[dict]: ...


def _unchanged(cfg: Any, num_target_layers: int) -> Any:
    return cfg


def _no_lm_head(head: dict) -> bool:
    return False


def _as_saved(head: dict, state: dict) -> dict:
    return head


@dataclass(frozen=True)
class HeadKind:
    """A head kind: its `head.<name>` config section and module, how it trains, drafts, is tuned and exported.

    Callables, with the arguments each stage passes:
        objective(kind config, seed=, loss_chunk=, ttt_attention=: train settings resolved) -> the kind's
            Objective (train/objectives/), called (heads, batch, Features, t2d) -> (loss, metrics) on each
            batch.
        drafter(heads, InferenceConfig, head config.json, num target layers) -> the neural drafter.
        draft_tokens(saved head section) -> the draft length a serving engine runs the head with.
        for_target(kind config, num target layers) -> the config with its target-dependent defaults resolved
            and checked (saved with the head).
        reduced_vocab(kind config) -> whether the head predicts over a draft vocabulary (d2t, built from the
            training data's most frequent tokens).
        reads_target_lm_head(saved head section) -> whether an engine export carries the target's lm_head.
        upgrade(saved head section, state) -> the section with the values heads saved before a setting
            existed.
        calibrate(target, heads, held-out samples, batch size, t2d) -> what the end of training measures on
            the held-out split and saves with the head (config.json `rank_accuracy`), or None.
    """

    name: str
    title: str  # for messages and docs: "Medusa-1/2", "EAGLE-1/2", "EAGLE-3"
    config: type  # the dataclass of the head.<name> section
    module: type  # the torch module: (cfg, hidden, vocab[, layer_config], d2t=) -> head
    layered: bool  # carries one decoder layer built from the target's config (head.<name>.draft_layer)
    objective: type  # a train.objectives.Objective subclass: (kind config, seed=) -> objective
    drafter: Callable[[Any, Any, dict, int], Any]
    tree_space: TreeSpace
    exports: dict[str, Any]  # export format -> export.layouts.Converter
    draft_tokens: Callable[[dict], int]
    refused_exports: dict[str, str] = field(default_factory=dict)  # format -> why not, and what to use
    for_target: Callable[[Any, int], Any] = _unchanged
    reduced_vocab: Callable[[Any], bool] = lambda cfg: False
    reads_target_lm_head: Callable[[dict], bool] = _no_lm_head
    upgrade: Callable[[dict, dict], dict] = _as_saved
    calibrate: Optional[Callable[..., Any]] = None
    adapts_target: bool = False  # may train LoRA adapters of the target with it (Medusa-2)
    # may draft in bf16 beside a float32 target (inference.drafter_dtype=auto): every weight its drafting
    # reads is its own (EAGLE-3's read-out is its own lm_head; EAGLE-1's is the target's, which a bf16 draft
    # would copy per call)
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
