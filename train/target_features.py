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

A packed batch (train/packing.py) given its sequences' bounds on the host (`segments`, from
`doc_segments` at plan time) runs each sequence alone: `document_causal` makes one SDPA call per
sequence on its slice of the row, causal with no mask (the flash kernel where the device has one)
and K/V at the model's own key-value head count (`enable_gqa`, no `repeat_kv`), so the forward costs
what its sequences need, not a [B, 1, T, T] mask and every cross-sequence block. The padding attends
nothing (its output is 0) and no token sees it. A sliding window applies within a sequence only: it
is plain causal attention when no sequence is longer than the window; otherwise, and for the
families with their own attention, the model's own implementation runs, and transformers finds the
sequences from the positions (and builds its dense mask). Given only the device's sequence ids
`doc`, the forward builds the dense document-causal mask [B, 1, T, T] instead: reading the bounds
back would stall the step.

Only the layers the head reads are kept: forward hooks capture them and the model is asked for no
`hidden_states` tuple, which would hold every layer's [B, T, h] until the step ends. No KV cache is
built.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import (
    repeat_kv,
    sdpa_attention_forward,
    use_gqa_in_sdpa,
)

from headway.errors import HeadwayError
from headway.train.packing import Segment

ATTENTION = "headway_causal"
# the running forward's packed batch: "segments", its sequences' bounds (`doc_segments`), or "mask",
# the dense document-causal mask made from its sequence ids
_packed: dict[str, Any] = {}


def causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with `is_causal` and no mask (query, key, value: [B, heads, T,
    D]); on a packed batch, `document_causal` over its sequences, or given only its sequence ids,
    SDPA under their dense document-causal mask."""
    kwargs.pop("is_causal", None)
    if "segments" in _packed:
        return document_causal(module, query, key, value, _packed["segments"], **kwargs)
    mask = _packed.get("mask")
    if mask is not None:
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def document_causal(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[Segment],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence alone (query, key, value: [B, heads, T, D];
    segments: (row, start, end) of each sequence): one SDPA call per sequence, `is_causal` and no
    mask, K/V not repeated where transformers' own unmasked call would not repeat them either
    (`use_gqa_in_sdpa`). Returns the output [B, T, heads, D], 0 at the padding, as transformers'
    implementations return theirs."""
    if softcap is not None or s_aux is not None:  # `unmasked_causal` keeps these families off
        raise HeadwayError("document-causal attention has no logit soft-capping and no sinks")
    longest = max((e - s for _, s, e in segments), default=0)
    if sliding_window is not None and longest > sliding_window:  # nor these (`_windowed`)
        raise HeadwayError(f"a {longest}-token sequence is longer than the {sliding_window} window")
    extra: dict[str, Any] = {}
    if key.shape[1] != query.shape[1]:
        if use_gqa_in_sdpa(None, key, value):
            extra["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    B, H, T, _ = query.shape
    if any(r >= B or e > T for r, _, e in segments):
        raise HeadwayError(f"packed sequences {segments} fall outside the [{B}, {T}] batch")
    out = query.new_zeros(B, T, H, value.shape[-1])
    for r, s, e in segments:
        o = torch.nn.functional.scaled_dot_product_attention(
            query[r : r + 1, :, s:e],
            key[r : r + 1, :, s:e],
            value[r : r + 1, :, s:e],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
            **extra,
        )
        out[r, s:e] = o[0].transpose(0, 1)
    return out, None


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
    model: torch.nn.Module,
    width: int,
    doc: Optional[torch.Tensor] = None,
    segments: Optional[list[Segment]] = None,
) -> Iterator[None]:
    """Run `model` under `causal_attention` inside the block (its own implementation where that is
    not SDPA's math, `_plain_sdpa`, or where a sliding window is narrower than `width`, the batch's
    length, or given `segments` the longest sequence: transformers then finds a packed batch's
    sequences from its positions itself).

    Args:
        doc: [B, T] a packed batch's sequence ids (on the device): the dense document-causal mask.
        segments: its sequences' bounds on the host (`doc_segments`), in place of `doc`: each
            sequence attends alone (`document_causal`), no mask.
    """
    configs = _configs(model)
    saved = [cfg._attn_implementation for cfg in configs]
    if segments is not None:  # a window applies within a sequence
        width = max((e - s for _, s, e in segments), default=0)
    if _windowed(configs, width) or not all(_plain_sdpa(model, s) for s in saved):
        yield
        return
    for cfg in configs:
        cfg._attn_implementation = ATTENTION
    if segments is not None:
        _packed["segments"] = segments
    elif doc is not None:
        # query t sees key s <= t of its own sequence: [B, 1, T, T], no gradient through it
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
    segments: Optional[list[Segment]] = None,
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
        segments: a packed batch's sequences as (row, start, end), read on the host
            (`doc_segments` of its doc at plan time): each attends alone with no mask, and `doc`
            is not needed; None: `doc`'s dense document-causal mask.
    Returns:
        (hidden, logits): index -> [B, T, h] for each of `layers`, and the logits [B, T, V] (or
        None).
    """
    decoder = _decoder(model)
    where = {} if positions is None else {"position_ids": positions}
    with unmasked_causal(model, ids.shape[1], doc, segments):
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
    segments: Optional[list[Segment]] = None,
) -> torch.Tensor:
    """The target's logits [B, T, V] on a right-padded or packed batch [B, T] (as
    `target_features`)."""
    where = {} if positions is None else {"position_ids": positions}
    with unmasked_causal(model, ids.shape[1], doc, segments):
        return model(input_ids=ids, use_cache=False, **where).logits
