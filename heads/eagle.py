"""EAGLE-1 drafter: one decoder layer that predicts the target's next feature from its current one.

Input at position t: fc([embedding(token t+1); target feature at t]) (2h -> h); one decoder layer of
the target's own architecture (without the input norm of layer 0, as EAGLE does); the output is the
predicted feature at t+1, read out by the target's own frozen lm_head. While drafting, the drafter's
own predicted feature replaces the target's. `EagleBase` is what EAGLE-1 and EAGLE-3 share: the
shared target embedding, the one-layer decoder and the step that runs it over a cache and a mask.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from headway.errors import HeadwayError
from headway.heads.config import EagleConfig
from headway.heads.draft_layer import build_draft_layer, cache_kwarg


class EagleBase(nn.Module):
    """The parts both EAGLE drafters share; subclasses define the input fusion and the read-out."""

    kind = "eagle"

    def __init__(self, hidden_size: int, vocab_size: int, layer_config: dict):
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.layer_config = dict(layer_config)
        self.decoder = build_draft_layer(layer_config)
        self._cache_kw = cache_kwarg(self.decoder)
        # the layer's raw output; EAGLE-3 keeps its own final norm
        self.decoder.norm = nn.Identity()
        self._embed: Optional[nn.Module] = None
        self._target_lm_head: Optional[torch.Tensor] = None

    @staticmethod
    def feature_layers(cfg: Any, num_target_layers: int) -> list[int]:
        """Indices into the target's `output_hidden_states` the drafter reads (EAGLE-1: the
        last, post-norm)."""
        return [num_target_layers]

    def attach_target(self, target_model: Any) -> None:
        """Share the target's embedding and lm_head (frozen, never saved with the head)."""
        object.__setattr__(self, "_embed", target_model.get_input_embeddings())
        self._target_lm_head = target_model.get_output_embeddings().weight.detach()

    def init_from_target(self, target_model: Any) -> None:
        """EAGLE-1 reads out through the target's lm_head itself: nothing to copy."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise HeadwayError("an EAGLE head needs attach_target(target model) before it runs")
        with torch.no_grad():
            if (
                self.cfg.draft_layer == "llama"
            ):  # engines feed an EAGLE draft the raw embedding table (no Gemma scale)
                return F.embedding(tokens, self._embed.weight).to(self.fc.weight.dtype)
            return self._embed(tokens).to(self.fc.weight.dtype)

    def run_decoder(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        cache: Any = None,
    ) -> torch.Tensor:
        """One pass of the decoder layer over x [B, T, h]; returns the layer's output before any
        final norm. A cache with its own `run` (the drafter's static cache) runs the layer
        itself."""
        if hasattr(cache, "run"):
            return cache.run(self.decoder, x, position_ids, attention_mask)
        kw = {self._cache_kw: cache} if cache is not None else {}
        out = self.decoder(
            inputs_embeds=x,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            **kw,
        )
        return out.last_hidden_state

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.d2t is None else len(self.d2t)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]


class EagleHead(EagleBase):
    """EAGLE-1: fc over [embedding; feature], one decoder layer, the target's lm_head."""

    kind = "eagle"

    def __init__(
        self,
        cfg: EagleConfig,
        hidden_size: int,
        vocab_size: int,
        layer_config: dict,
        d2t: Optional[torch.Tensor] = None,
    ):
        super().__init__(hidden_size, vocab_size, layer_config)
        if d2t is not None:
            raise HeadwayError(
                "EAGLE-1 reads out through the target's full lm_head: it takes no draft vocabulary"
            )
        self.cfg = cfg
        self.d2t = None  # draft ids are target ids
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=cfg.fc_bias)
        self.decoder.layers[0].input_layernorm = nn.Identity()

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """The drafter's h-wide input from the target's features (EAGLE-1: the feature itself)."""
        return target_features

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Predicted features [B, T, h] for positions whose token is `tokens` and feature is
        `hidden`."""
        x = self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))
        return self.run_decoder(x, position_ids, attention_mask, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.readout_weight.to(out.dtype).T

    @property
    def readout_weight(self) -> torch.Tensor:
        """The [V, h] weight `logits` multiplies by: the target's own lm_head (frozen)."""
        if self._target_lm_head is None:
            raise HeadwayError("an EAGLE head needs attach_target(target model) before it runs")
        return self._target_lm_head

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft step takes as its feature: the predicted feature."""
        return out
