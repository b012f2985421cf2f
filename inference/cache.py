"""KV-cache bookkeeping for tree verification, on the model's own transformers cache.

After a tree forward the cache holds the prefix plus every tree node; only the accepted path stays.
"""

from __future__ import annotations

from typing import Any

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import cache_kwarg  # noqa: F401  (re-exported for the decoding loop)


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def sliding_window_limit(model: Any) -> int | None:
    """Longest sequence a tree may reach on a model with sliding-window layers (None: no limit).

    Sliding layers drop old keys as they go, so a rejected branch cannot be undone past the window.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    if window and (any(t == "sliding_attention" for t in layer_types) or not layer_types):
        return int(window) - 1
    return None


def keep_tree_nodes(cache: Any, tree_size: int, keep: list[int]) -> None:
    """Drop the rejected tree nodes: the last `tree_size` cache entries become those at indices `keep`."""
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        n = k.shape[-2]
        if n < tree_size:
            raise HeadwayError(
                "the KV cache holds fewer entries than the tree: the sequence outgrew a sliding window"
            )
        sel = torch.tensor(keep, device=k.device) + (n - tree_size)
        layer.keys = torch.cat([k[..., : n - tree_size, :], k.index_select(-2, sel)], dim=-2)
        layer.values = torch.cat([v[..., : n - tree_size, :], v.index_select(-2, sel)], dim=-2)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= tree_size - len(keep)


def truncate_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of every layer (transformers' own `crop` changed meaning
    across versions)."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        removed = layer.keys.shape[-2] - length
        if removed <= 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= removed
