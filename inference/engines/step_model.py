"""A target's decoder as Headway's fixed-shape steps run it: its layers (engine_step's math for its
family), its final norm, its rotary tables for every cache slot, and its lm_head with the final
soft-capping.

The CUDA backend's speculative runner (engines/cuda/runner.py) and the batched decoder of
self-distillation (engines/batch.py) share it, so both run the arithmetic that the tests prove
against the model's own forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference.engines.layer_step import (
    GEMMA3_FAMILIES,
    LayerPlan,
    _rms_norm_fn,
    gemma3_layer_step,
    layer_step,
    rope_tables,
)


class StepModel:
    """The parts of `model` a step calls.

    Args:
        model: a static-family or Gemma-3 causal LM (engine_cuda.cuda_supported: Qwen3's q/k norms
            and SmolLM3's NoPE layers included, MoE blocks not); positions: the rotary tables cover
            positions [0, positions)."""

    def __init__(self, model: Any, positions: int):
        cfg = text_config(model.config)
        # the parts, not the model: a runner (and its graphs) must not keep the model it was made
        # for alive
        self.base, self.lm_head = model.model, model.lm_head
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layers = list(self.base.layers)
        self.gemma3 = getattr(cfg, "model_type", None) in GEMMA3_FAMILIES
        self.plans = [None if self.gemma3 else LayerPlan(layer, lean=True) for layer in self.layers]
        if any(plan is not None and plan.moe is not None for plan in self.plans):
            # (its row-by-row routing reads the host mid-step: no fixed-shape step, no graph)
            raise HeadwayError(
                f"the fixed-shape steps do not run MoE layers (this '{cfg.model_type}' target's): use the "
                "static engine on a CPU, or hf"
            )
        self.norm = _rms_norm_fn(self.base.norm, lean=True)
        # each layer's kind (Gemma-3: sliding_attention or full_attention), its rotary tables and
        # mask
        self.kinds = list(
            getattr(cfg, "layer_types", None) or ["full_attention"] * len(self.layers)
        )
        self.window = getattr(cfg, "sliding_window", None) if self.gemma3 else None
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        self.kv_heads, self.head_dim = int(cfg.num_key_value_heads), int(attn.head_dim)
        # the rotary tables of every position, once per layer kind: each position's values are what
        # rotary_emb gives it per call
        every = torch.arange(positions, device=self.device).view(1, -1)
        probe = torch.zeros(1, 1, dtype=self.dtype, device=self.device)
        self.rope = {
            kind: rope_tables(*self.base.rotary_emb(probe, every, *([kind] if self.gemma3 else [])))
            for kind in set(self.kinds)
        }

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> rows [n, hidden] (the model's own embedding, Gemma-3's scale
        included)."""
        return self.base.embed_tokens(ids)

    def layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        end: int,
        mask: Optional[torch.Tensor],
        causal: bool = False,
        attend: Optional[Any] = None,
    ) -> torch.Tensor:
        """Decoder layer i over rows x [n, hidden] (engine_step's `layer_step` contract: keys and
        values into cache `slots`, attention over [0, end) under `mask`, or `causal`, or by
        `attend`)."""
        if self.gemma3:
            return gemma3_layer_step(
                self.layers[i], x, cos, sin, k, v, slots, end, mask, causal, attend
            )
        return layer_step(self.plans[i], x, cos, sin, k, v, slots, end, mask, attend, causal=causal)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The lm_head over normed rows x [n, hidden] in one matmul (then the final soft-capping,
        where the model has it): [n, vocab]."""
        logits = self.lm_head(x)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
