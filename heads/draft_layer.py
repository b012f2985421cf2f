"""The EAGLE drafters' decoder: a one-layer copy of the target's own base model class.

Building it from the target's config and classes (not a forked modeling file) means the drafter
follows the target's architecture (RoPE variant, GQA, norms) and uses transformers' own cache and
mask handling, tree masks included. The drafter feeds it `inputs_embeds`, so its word embedding is
dropped: the target's embedding is shared instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from headway.errors import HeadwayError


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def draft_layer_config(target_config: Any) -> dict:
    """The target's text config as a dict, cut to one full-attention layer: saved with the head."""
    cfg = text_config(target_config).to_dict()
    cfg["num_hidden_layers"] = 1
    if cfg.get("layer_types"):
        cfg["layer_types"] = ["full_attention"]
    for key in ("architectures", "auto_map", "quantization_config", "_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["use_cache"] = True
    return cfg


def build_draft_layer(layer_config: dict) -> nn.Module:
    """A one-layer base model (e.g. LlamaModel) from a draft_layer_config dict, without its embedding."""
    from transformers import AutoConfig, AutoModel

    cfg = dict(layer_config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise HeadwayError("the head's draft layer config has no model_type: re-train or re-export the head")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        model = AutoModel.from_config(config)
    except (ValueError, KeyError) as e:
        raise HeadwayError(f"this transformers cannot build a '{model_type}' layer for the drafter: {e}") from None
    if not hasattr(model, "layers") or len(model.layers) != 1:
        raise HeadwayError(f"'{model_type}' models have no `layers` list: EAGLE heads support decoder-only text targets")
    model.embed_tokens = None  # inputs_embeds only: the target's embedding is shared, never stored twice
    return model


def cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def drafter_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [B, 1, q, k] from a bool [B, q, k] (True: may attend)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.unsqueeze(1)
