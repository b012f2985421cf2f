"""The frozen target's forward in training: the hidden states the head reads, and its logits, read
nothing back to the host.

Training batches are right-padded, so plain causal attention keeps every real token from the padding
after it and no mask is needed. transformers would still inspect the batch on the host: with no mask
it checks the position ids for packed sequences, with one it checks whether all of it is real (each
a device-to-host read per forward). `causal_attention` is registered as an attention implementation
with no mask function, so transformers builds no mask and checks nothing, and it runs the same SDPA
call transformers' own implementation makes with no mask (the same bits). A model keeps its own
implementation where that is not plain SDPA math: sliding-window layers narrower than the batch (the
window applies), and families whose attention SDPA cannot express (gpt-oss's sinks, Gemma-2's logit
soft-capping: their model classes say `_supports_sdpa = False`, and they load with eager attention).

Only the layers the head reads are kept: forward hooks capture them and the model is asked for no
`hidden_states` tuple, which would hold every layer's [B, T, h] until the step ends. No KV cache is
built.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "headway_causal"
# the running forward's document-causal mask, on a packed batch
_packed: dict[str, torch.Tensor] = {}


def causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with `is_causal` and no mask (query, key, value: [B, heads, T,
    D]); on a packed batch, with its document-causal mask."""
    kwargs.pop("is_causal", None)
    mask = _packed.get("mask")
    if mask is not None:
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


AttentionInterface.register(ATTENTION, causal_attention)


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct config object the model's modules read their attention implementation from."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def _windowed(configs: list[Any], width: int) -> bool:
    """True when some layer attends through a sliding window narrower than the batch."""
    for cfg in configs:
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if window and width > window and (types is None or "sliding_attention" in types):
            return True
    return False


def _plain_sdpa(model: torch.nn.Module, implementation: Optional[str]) -> bool:
    """Whether attention under `implementation` is SDPA's math, which `causal_attention` repeats:
    sdpa itself, or eager on a model class that supports SDPA (one whose attention has nothing SDPA
    lacks, no sinks and no soft-capping)."""
    if implementation == "sdpa":
        return True
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return implementation == "eager" and bool(getattr(type(base), "_supports_sdpa", False))


@contextmanager
def unmasked_causal(
    model: torch.nn.Module, width: int, doc: Optional[torch.Tensor] = None
) -> Iterator[None]:
    """Run `model` under `causal_attention` inside the block (its own implementation where that is
    not SDPA's math, `_plain_sdpa`, or where a sliding window is narrower than `width`, the batch's
    length: transformers then finds a packed batch's sequences from its positions itself). `doc` [B,
        T]: a packed batch's sequence
    ids."""
    configs = _configs(model)
    saved = [cfg._attn_implementation for cfg in configs]
    if _windowed(configs, width) or not all(_plain_sdpa(model, s) for s in saved):
        yield
        return
    for cfg in configs:
        cfg._attn_implementation = ATTENTION
    # query t sees key s <= t of its own sequence: [B, 1, T, T], no gradient through it
    if doc is not None:
        T = doc.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        _packed["mask"] = (causal & (doc.unsqueeze(-1) == doc.unsqueeze(1))).unsqueeze(1)
    try:
        yield
    finally:
        _packed.clear()
        for cfg, s in zip(configs, saved):
            cfg._attn_implementation = s


def _decoder(model: torch.nn.Module) -> Optional[Any]:
    """The decoder stack (embed_tokens, layers, norm) of a causal LM, also under a PEFT wrapper;
    None when the model is laid out otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    if all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return inner
    return None


def target_features(
    model: torch.nn.Module,
    ids: torch.Tensor,
    layers: list[int],
    positions: Optional[torch.Tensor] = None,
    doc: Optional[torch.Tensor] = None,
    logits: bool = True,
) -> tuple[dict[int, torch.Tensor], Optional[torch.Tensor]]:
    """The target's forward on a right-padded or packed batch.

    Args:
        model: the target (a transformers causal LM, possibly LoRA-wrapped).
        ids: [B, T] token ids, right-padded, or packed (train/packing.py).
        layers: hidden-state indices the head reads, as in transformers' `hidden_states` (0: the
            embeddings,
            i: after decoder layer i, the last: after the final norm).
        positions, doc: [B, T] a packed batch's positions and sequence ids (None: right-padded).
        logits: run the lm_head; False: the decoder stack only, and logits None.
    Returns:
        (hidden, logits): index -> [B, T, h] for each of `layers`, and the logits [B, T, V] (or
        None).
    """
    decoder = _decoder(model)
    where = {} if positions is None else {"position_ids": positions}
    with unmasked_causal(model, ids.shape[1], doc):
        if decoder is None:
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False, **where)
            return {i: out.hidden_states[i] for i in layers}, out.logits
        n = len(decoder.layers)
        caught: dict[int, torch.Tensor] = {}

        def keep(i: int) -> Any:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                caught[i] = output[0] if isinstance(output, tuple) else output

            return hook

        ends = {0: decoder.embed_tokens, n: decoder.norm}
        hooks = [
            (ends[i] if i in ends else decoder.layers[i - 1]).register_forward_hook(keep(i))
            for i in set(layers)
        ]
        try:
            if logits:
                out = model(input_ids=ids, use_cache=False, **where).logits
            else:
                out = None
                decoder(input_ids=ids, use_cache=False, **where)
        finally:
            for h in hooks:
                h.remove()
    return {i: caught[i] for i in layers}, out


def target_logits(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    doc: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The target's logits [B, T, V] on a right-padded or packed batch [B, T] (as
    `target_features`)."""
    where = {} if positions is None else {"position_ids": positions}
    with unmasked_causal(model, ids.shape[1], doc):
        return model(input_ids=ids, use_cache=False, **where).logits
