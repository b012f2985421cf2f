"""The hf engine (`inference.engine=hf`): the model's own forward (`HFRunner`) on its own
transformers cache, with the KV-cache bookkeeping tree verification needs.

After a tree forward the cache holds the prefix plus every tree node; only the accepted path stays.

Sliding-window layers keep every key here (transformers' own cache drops keys as the window moves,
so a rejected branch could not be undone past it, and a tree's rows could not see the keys the
window still shows them): the window is applied by the mask instead, one per layer type
(`step_masks`), from each row's position. A recurrent layer (SSM, linear attention, convolution)
keeps one state that a tree's branches would share; it cannot be rolled back, and `keep_tree_nodes`
/ `truncate_cache` refuse it in one line.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import cache_kwarg
from headway.inference.engines.tree import Tree, tree_attention_bias

SLIDING = "sliding_attention"
FULL = "full_attention"


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def new_cache(model: Any) -> Any:
    """A transformers DynamicCache for `model` whose sliding-window layers keep every key (full
    layers), so that trees can be verified and rolled back at any length; other layer kinds stay as
    transformers makes them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
    return cache


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def attention_windows(model: Any) -> dict[str, Optional[int]]:
    """How far back each layer type attends, for models with sliding-window layers ({} without any:
    the model builds its own causal mask).

    Returns:
        {layer type: window or None (full attention)} where the config names layer types (the
        model's forward then takes a dict of masks keyed by layer type), or {"": window} where every
        layer slides over the same window (Mistral-style configs without layer types: one 4-D mask
        for every layer).
    """
    cfg = _text_config(model)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return {}
    if not types:
        return {"": int(window)}
    if SLIDING not in types:
        return {}
    return {t: (int(window) if t == SLIDING else None) for t in {*types, FULL}}


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive 4-D mask [1, 1, n, K] from a boolean [n, K]: 0 where visible, else the dtype's
    minimum."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, torch.finfo(dtype).min).view(1, 1, *visible.shape)


def step_masks(
    windows: dict[str, Optional[int]],
    prefix: int,
    query_pos: torch.Tensor,
    visible: torch.Tensor,
    dtype: torch.dtype,
) -> Any:
    """The attention mask(s) of one forward over a cache of `prefix` keys plus the step's own rows.

    Args:
        windows: `attention_windows(model)`, not empty.
        prefix: the keys already cached; query_pos [n]: each new row's position (prefix + depth in a
            tree).
        visible [n, n]: which of the step's own rows each row sees (causal, or its tree ancestors).
        dtype: the mask's dtype (the model's).
    Returns:
        One additive 4-D mask [1, 1, n, prefix + n] where every layer shares a window, else a dict
        of them keyed by layer type; a sliding layer's hides every key more than window - 1
        positions behind the row.
    """
    device = query_pos.device
    n = query_pos.shape[0]
    key_pos = torch.cat([torch.arange(prefix, device=device), query_pos])
    seen = torch.cat(
        [torch.ones(n, prefix, dtype=torch.bool, device=device), visible.to(device)], dim=1
    )
    behind = query_pos[:, None] - key_pos[None, :]
    masks = {
        kind: _bias(seen if window is None else seen & (behind < window), dtype)
        for kind, window in windows.items()
    }
    return masks[""] if "" in masks else masks


def _refuse_recurrent(layer: Any) -> None:
    """Refuse to edit a recurrent layer's cache: its one state cannot drop a rejected branch or go
    back."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if isinstance(layer, LinearAttentionCacheLayerMixin) or not hasattr(layer, "keys"):
        raise HeadwayError(
            f"this target's cache has a recurrent layer ({type(layer).__name__}: SSM, linear attention or "
            "convolution state) that a draft tree's branches would share and that cannot be rolled back: "
            "speculative decoding cannot run on it; decode it without a draft"
        )


def has_recurrent_state(cache: Any) -> bool:
    """Whether some layer of `cache` keeps a recurrent state (alone or beside its keys and
    values)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return any(
        isinstance(layer, LinearAttentionCacheLayerMixin) or not hasattr(layer, "keys")
        for layer in cache.layers
    )


def keep_tree_nodes(cache: Any, tree_size: int, keep: list[int]) -> None:
    """Drop the rejected tree nodes: the last `tree_size` cache entries become those at indices
    `keep`."""
    for layer in cache.layers:
        _refuse_recurrent(layer)
        k, v = layer.keys, layer.values
        if k is None or k.numel() == 0:  # a layer that stores nothing (shared or attention-free)
            continue
        n = k.shape[-2]
        if n < tree_size:
            raise HeadwayError(
                f"the KV cache ({type(layer).__name__}) holds fewer entries ({n}) than the tree "
                f"({tree_size}): this layer kind drops keys as it goes; decode this target without a draft"
            )
        sel = torch.tensor(keep, device=k.device) + (n - tree_size)
        layer.keys = torch.cat([k[..., : n - tree_size, :], k.index_select(-2, sel)], dim=-2)
        layer.values = torch.cat([v[..., : n - tree_size, :], v.index_select(-2, sel)], dim=-2)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= tree_size - len(keep)


def truncate_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of every layer (transformers' own `crop` changed meaning
    across versions)."""
    shorter = length < cache_length(cache)
    for layer in cache.layers:
        if shorter:
            _refuse_recurrent(layer)
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        removed = layer.keys.shape[-2] - length
        if removed <= 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= removed


class HFRunner:
    """The model's own forward and a transformers DynamicCache.

    On a model with sliding-window layers the cache keeps every key (`new_cache`) and every forward,
    plain or tree, passes the masks itself (`step_masks`: one per layer type, the window measured
    from each row's position), so plain and speculative decoding see the same keys at any length and
    a rejected branch is dropped like any other. A model with a recurrent layer decodes plainly; a
    tree on it is refused.
    """

    accepts_on_device = False  # (Runner protocol: engines/runner.py)

    def __init__(self, model: Any):
        self.model = model
        self.cache = new_cache(model)
        self.kw = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.windows = attention_windows(model)

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[torch.Tensor, Any]:
        extra: dict[str, Any] = {}
        prefix = self.length
        if tree is not None:
            if has_recurrent_state(self.cache):
                raise HeadwayError(
                    f"this '{getattr(self.model.config, 'model_type', '?')}' target keeps a recurrent state "
                    "(SSM, linear attention or convolution) that a draft tree's branches would share: "
                    "speculative decoding cannot verify a tree on it; decode it without a draft"
                )
            pos = prefix + tree.depth.to(self.device)
            extra["position_ids"] = pos.view(1, -1)
            if self.windows:
                extra["attention_mask"] = step_masks(
                    self.windows, prefix, pos, tree.ancestors, self.dtype
                )
            else:
                extra["attention_mask"] = tree_attention_bias(tree, prefix, self.dtype, self.device)
        elif self.windows:
            n = ids.numel()
            pos = torch.arange(prefix, prefix + n, device=self.device)
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            extra["position_ids"] = pos.view(1, -1)
            extra["attention_mask"] = step_masks(self.windows, prefix, pos, causal, self.dtype)
        o = self.model(
            ids.view(1, -1).to(self.device),
            use_cache=True,
            output_hidden_states=hidden,
            **{self.kw: self.cache},
            **extra,
        )
        return o.logits[0], o.hidden_states

    def keep(self, tree_size: int, keep: list[int]) -> None:
        keep_tree_nodes(self.cache, tree_size, keep)

    def truncate(self, length: int) -> None:
        truncate_cache(self.cache, length)
