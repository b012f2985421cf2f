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


def draft_layer_config(target_config: Any, style: str = "target") -> dict:
    """The draft layer's config as a dict, saved with the head: one full-attention layer of the
    target's own class (style=target), or a Llama layer with the target's sizes, GQA, RoPE and norm
    epsilon (style=llama)."""
    if style == "llama":
        return llama_layer_config(target_config)
    cfg = text_config(target_config).to_dict()
    cfg["num_hidden_layers"] = 1
    if cfg.get("layer_types"):
        cfg["layer_types"] = ["full_attention"]
    for key in (
        "architectures",
        "auto_map",
        "quantization_config",
        "_name_or_path",
        "transformers_version",
    ):
        cfg.pop(key, None)
    cfg["use_cache"] = True
    return cfg


def _full_attention_rope(t: Any) -> dict:
    """The RoPE parameters of the target's full-attention layers (transformers 5 keeps them per
    layer type)."""
    rope = getattr(t, "rope_parameters", None) or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    theta = rope.get("rope_theta", getattr(t, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(theta)
    return rope


def llama_layer_config(target_config: Any) -> dict:
    """A one-layer Llama config with the target's sizes: the draft layer serving engines build."""
    t = text_config(target_config)
    h, heads = int(t.hidden_size), int(t.num_attention_heads)
    rope = _full_attention_rope(t)
    return {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": int(t.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(t, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(t, "head_dim", None) or h // heads),
        "num_hidden_layers": 1,
        "hidden_act": "silu",  # the engines' Llama MLP supports SiLU only
        "rms_norm_eps": float(getattr(t, "rms_norm_eps", None) or 1e-6),
        "max_position_embeddings": int(t.max_position_embeddings),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "vocab_size": int(t.vocab_size),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(t, "bos_token_id", None),
        "eos_token_id": getattr(t, "eos_token_id", None),
        "pad_token_id": getattr(t, "pad_token_id", None),
        "use_cache": True,
    }


def build_draft_layer(layer_config: dict) -> nn.Module:
    """A one-layer base model (e.g. LlamaModel) from a draft_layer_config dict, without its
    embedding."""
    from transformers import AutoConfig, AutoModel

    cfg = dict(layer_config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise HeadwayError(
            "the head's draft layer config has no model_type: re-train or re-export the head"
        )
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        model = AutoModel.from_config(config)
    except (ValueError, KeyError) as e:
        raise HeadwayError(
            f"this transformers cannot build a '{model_type}' layer for the drafter: {e}"
        ) from None
    if not hasattr(model, "layers") or len(model.layers) != 1:
        raise HeadwayError(
            f"'{model_type}' models have no `layers` list: EAGLE heads support decoder-only text targets"
        )
    # inputs_embeds only: the target's embedding is shared, never stored twice
    model.embed_tokens = None
    return model


def cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version's forward
    takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def drafter_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [B, 1, q, k] from a bool [B, q, k] (True: may attend)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.unsqueeze(1)
