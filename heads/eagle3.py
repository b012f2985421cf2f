"""EAGLE-3 drafter: target features fused from three layers, its own small draft vocabulary.

Input at position t: fc([low; middle; high] target hidden states at t) (3h -> h), one decoder layer
of the target's architecture whose attention reads [norm(embedding(token t+1)); norm(hidden)] (2h
wide) with the hidden as the residual stream, then a final norm and an lm_head over a reduced draft
vocabulary (d2t maps draft ids to target ids). While drafting, the layer's own output replaces the
fused feature, which is what training-time test unrolls in training.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from headway.errors import HeadwayError
from headway.heads.config import Eagle3Config
from headway.heads.eagle import EagleBase


def fused_layers(section: str, layers: list[int], num_target_layers: int) -> list[int]:
    """The fused target layers: the config's, or the low/middle/high default (2, L//2, L-3) that
    vLLM and SGLang feed by default (1, L//2, L-1 on targets too shallow for it)."""
    L = num_target_layers
    if layers:
        bad = [i for i in layers if not 0 <= i <= L]
        if bad:
            raise HeadwayError(f"{section}.feature_layers {bad} outside the target's 0..{L}")
        return list(layers)
    if L < 4:
        raise HeadwayError(
            f"{section} fuses three distinct layer outputs before the last of the target's layers, "
            f"and this target has {L}: use head.kind=eagle"
        )
    default = [2, L // 2, L - 3]
    return default if default == sorted(set(default)) else [1, L // 2, L - 1]


def check_servable_layers(section: str, layers: list[int], num_target_layers: int) -> None:
    """Refuse fused layers that engines capture otherwise: each must be a decoder layer's output
    before the last one (1..L-1), since the last (HF index L) is post-norm in HF but captured
    pre-norm by the engines."""
    L = num_target_layers
    bad = [i for i in layers if not 1 <= i <= L - 1]
    if bad:
        raise HeadwayError(
            f"{section}.feature_layers {bad} outside this {L}-layer target's 1..{L - 1} (the last "
            f"layer's output, {L}, is post-norm in HF and not what engines capture): choose from "
            f"1..{L - 1}"
        )


class FusedInputNorm(nn.Module):
    """Stands in for the layer's input norm: [norm(embedding); norm(hidden)], the embedding set per
    call."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.emb_norm = copy.deepcopy(norm)
        self.hidden_norm = copy.deepcopy(norm)
        self.embedding: Optional[torch.Tensor] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embedding is None:
            raise HeadwayError("internal: the EAGLE-3 layer ran without its token embedding")
        # the static engine runs the layer over rows [n, H], transformers over [1, n, H]
        embedding = self.embedding.reshape(*hidden.shape[:-1], -1)
        return torch.cat([self.emb_norm(embedding), self.hidden_norm(hidden)], dim=-1)


class Eagle3Head(EagleBase):
    kind = "eagle3"

    def __init__(
        self,
        cfg: Eagle3Config,
        hidden_size: int,
        vocab_size: int,
        layer_config: dict,
        d2t: Optional[torch.Tensor] = None,
    ):
        super().__init__(hidden_size, vocab_size, layer_config)
        self.cfg = cfg
        self.fc = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        layer = self.decoder.layers[0]
        fused = FusedInputNorm(layer.input_layernorm)
        layer.input_layernorm = fused
        object.__setattr__(
            self, "fused_norm", fused
        )  # a handle, not a second registration of the same weights
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            new = nn.Linear(2 * hidden_size, old.out_features, bias=old.bias is not None)
            nn.init.normal_(new.weight, std=float(layer_config.get("initializer_range", 0.02)))
            if new.bias is not None:
                nn.init.zeros_(new.bias)
            setattr(attn, name, new)
        self.norm = copy.deepcopy(fused.hidden_norm)
        # EAGLE-3.1's input norms, copied from the fresh layer's norm (its initial weights, the norm
        # class of the layer's family); speculators' names, which its export keeps
        if cfg.input_norm == "per_layer":
            self.fc_norm = nn.ModuleList(copy.deepcopy(fused.hidden_norm) for _ in range(3))
        elif cfg.input_norm == "concat":
            norm = fused.hidden_norm
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
            self.input_norm = type(norm)(3 * hidden_size, eps=eps)
        if d2t is None:
            d2t = torch.arange(min(cfg.draft_vocab_size, vocab_size))
        if len(d2t) > vocab_size or int(d2t.max()) >= vocab_size:
            raise HeadwayError(
                f"draft vocabulary ({len(d2t)} ids, max {int(d2t.max())}) "
                f"does not fit the target's {vocab_size}"
            )
        self.register_buffer("d2t", d2t.to(torch.long).clone(), persistent=True)
        self.lm_head = nn.Linear(hidden_size, len(d2t), bias=False)

    @staticmethod
    def feature_layers(cfg: Eagle3Config, num_target_layers: int) -> list[int]:
        """The fused target layers: cfg's, or the low/middle/high default (2, L//2, L-3) that vLLM
        and SGLang feed by default (1, L//2, L-1 on targets too shallow for it)."""
        return fused_layers("head.eagle3", list(cfg.feature_layers), num_target_layers)

    @staticmethod
    def check_servable(layers: list[int], num_target_layers: int) -> None:
        """Refuse fused layers that engines capture otherwise: each must be a decoder layer's output
        before the last one (1..L-1), since the last (HF index L) is post-norm in HF but captured
        pre-norm by the engines."""
        check_servable_layers("head.eagle3", layers, num_target_layers)

    def init_from_target(self, target_model: Any) -> None:
        """Start the read-out where the target's is: its final norm and its lm_head rows for the
        draft vocabulary."""
        target_lm_head = target_model.get_output_embeddings().weight
        final_norm = getattr(getattr(target_model, "model", None), "norm", None)
        with torch.no_grad():
            self.lm_head.weight.copy_(
                target_lm_head[self.d2t.to(target_lm_head.device)].to(self.lm_head.weight.dtype)
            )
            if final_norm is not None and type(final_norm) is type(self.norm):
                self.norm.load_state_dict(final_norm.state_dict())
            # fc starts by passing the highest fused layer through: the untrained drafter then reads
            # the target's own late residual stream out through the target's own norm and lm_head.
            h = self.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * h :] = torch.eye(h, dtype=self.fc.weight.dtype)
        if self.cfg.init_layer >= 0:
            self.copy_target_layer(target_model, self.cfg.init_layer)

    def copy_target_layer(self, target_model: Any, index: int) -> None:
        """Start the draft layer as target layer `index`: its attention reads the hidden half of the
        [embedding; hidden] input through the target's q/k/v (the embedding half starts at zero),
        and its output projection, MLP and norms are the target's."""
        layers = target_model.get_decoder().layers
        if not 0 <= index < len(layers):
            raise HeadwayError(
                f"head.eagle3.init_layer={index} is not a layer of this {len(layers)}-layer target: "
                f"use 0..{len(layers) - 1}, or -1 for random initialisation"
            )
        source = layers[index].state_dict()
        own = self.decoder.layers[0]
        h = self.hidden_size
        names = {
            n.replace("input_layernorm.emb_norm.", "input_layernorm.").replace(
                "input_layernorm.hidden_norm.", "input_layernorm."
            )
            for n in own.state_dict()
        }
        left = sorted(k for k in source if k not in names)
        if left or type(layers[index].input_layernorm) is not type(self.norm):
            raise HeadwayError(
                f"head.eagle3.init_layer={index}: the target's layers ({type(layers[index]).__name__}) do "
                f"not map onto this draft layer ({type(own).__name__}; "
                f"{', '.join(left[:3]) or 'other norms'} have no counterpart): set "
                "head.eagle3.draft_layer=target to copy a target layer, or init_layer=-1"
            )
        with torch.no_grad():
            for name, value in own.state_dict().items():
                key = name.replace("input_layernorm.emb_norm.", "input_layernorm.").replace(
                    "input_layernorm.hidden_norm.", "input_layernorm."
                )
                if key not in source:
                    continue
                src = source[key].to(value.dtype)  # state_dict values share the parameters' storage
                if value.shape == src.shape:
                    value.copy_(src)
                elif (
                    value.dim() == 2 and value.shape == (src.shape[0], 2 * h) and src.shape[1] == h
                ):
                    value.zero_()
                    value[:, h:] = src

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """The drafter's h-wide input [.., h] from the concatenated low/middle/high target features
        [.., 3h] (each normalised first with head.eagle3.input_norm=per_layer, all three with
        concat)."""
        x = target_features.to(self.fc.weight.dtype)
        if self.cfg.input_norm == "per_layer":
            x = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1
            )
        elif self.cfg.input_norm == "concat":
            x = self.input_norm(x)
        return self.fc(x)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """The layer's output [B, T, h] (pre-norm) for positions with `tokens` and h-wide input
        `hidden`."""
        self.fused_norm.embedding = self.embed(tokens)
        try:
            return self.run_decoder(
                hidden.to(self.fc.weight.dtype), position_ids, attention_mask, cache
            )
        finally:
            self.fused_norm.embedding = None

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over draft ids."""
        return self.lm_head(self.norm(out))

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden the next drafting step reads: the layer's output, or (norm_output) its
        final-normed form."""
        return self.norm(out) if self.cfg.norm_output else out
