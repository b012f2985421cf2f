"""Model FLOPs of a training micro-batch, per head kind, from its planned shapes alone (no device
work).

The count is of matrix products (linear layers, attention scores and values, lm_heads), the
convention of torch's FlopCounterMode, which checks it (tests/train/test_flops.py). Padding counts:
the hardware computes it. Attention counts the whole [queries, keys] product, masked or not, as the
kernels the step runs compute it. A product's backward costs twice its forward (the gradients of
both operands), once where its input needs no gradient (the first layer after the frozen features,
the frozen lm_heads' input gradient only). The frozen target runs forward only; Medusa-2's adapted
target's backward is not counted.

Throughput and MFU in the logs use it (train/metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from headway.heads.draft_layer import text_config


@dataclass(frozen=True)
class Dims:
    """A decoder's widths: hidden, query and key/value widths (heads x head_dim), MLP width, query
    heads."""

    hidden: int
    q: int
    kv: int
    mlp: int
    heads: int
    layers: int = 1
    vocab: int = 0

    @classmethod
    def of(cls, config: Any) -> "Dims":
        """From an HF config (or its dict)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(get("head_dim", None) or h // heads)
        kv_heads = int(get("num_key_value_heads", None) or heads)
        return cls(
            h,
            heads * head_dim,
            kv_heads * head_dim,
            int(get("intermediate_size")),
            heads,
            int(get("num_hidden_layers", 1) or 1),
            int(get("vocab_size", 0) or 0),
        )

    @property
    def head_dim(self) -> int:
        return self.q // self.heads


def linear(rows: int, d_in: int, d_out: int) -> float:
    """A [rows, d_in] x [d_in, d_out] product."""
    return 2.0 * rows * d_in * d_out


def layer_linears(rows: int, d: Dims, qkv_in: int = 0) -> float:
    """A decoder layer's projections and gated MLP over `rows` tokens (q/k/v read `qkv_in` features:
    EAGLE-3's 2h; default the hidden width)."""
    qkv_in = qkv_in or d.hidden
    return (
        linear(rows, qkv_in, d.q + 2 * d.kv)
        + linear(rows, d.q, d.hidden)
        + 3 * linear(rows, d.hidden, d.mlp)
    )


def attention(batch: int, queries: int, keys: int, d: Dims) -> float:
    """Scores and weighted values of `queries` x `keys` over every query head."""
    return 4.0 * batch * d.heads * queries * keys * d.head_dim


def target_forward(batch: int, width: int, target: Dims, lm_head: bool = True) -> float:
    """The frozen target's forward, with its full-vocabulary logits unless `lm_head` is False."""
    tokens = batch * width
    per_layer = layer_linears(tokens, target) + attention(batch, width, width, target)
    return target.layers * per_layer + (
        linear(tokens, target.hidden, target.vocab) if lm_head else 0.0
    )


def counter(
    objective: Any, heads: Any, target: Any, online: bool = True, lm_head: bool = True
) -> Callable[[dict], float]:
    """The model FLOPs of one of this run's planned micro-batches (train/step.py plans them): the
    head's forward and backward (its kind's objective counts them: `Objective.flops`), plus the
    target's forward when it runs online.

    Args:
        objective: the kind's objective; heads: the built head; target: the loaded target.
        online: the target runs in each step (train.features_dir unset).
        lm_head: the target's full lm_head runs (False: train.target_argmax=data skips it).
    Returns:
        plan -> FLOPs, `plan` the micro-batch's host tensors (input_ids [B, T] and the kind's plan).
    """
    dims = Dims.of(text_config(target.config))

    def count(plan: dict[str, torch.Tensor]) -> float:
        B, T = plan["input_ids"].shape
        return objective.flops(heads, plan, dims) + (
            target_forward(B, T, dims, lm_head) if online else 0.0
        )

    return count
