"""The head a run trains: fresh for the target (a draft vocabulary from the training data) or from
train.init_from's weights; the target hidden states it reads; Medusa-2's LoRA adapters on the
target."""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import draft_layer_config, text_config
from headway.kinds.checkpoint import load_head
from headway.kinds.config import HeadConfig
from headway.kinds.head_dir import read_head_config
from headway.kinds.registry import head_kind
from headway.target.packed_model import linear_weights
from headway.train.data import token_frequencies

log = logging.getLogger("headway")


def add_lora(model: Any, lora: Any) -> Any:
    """Wrap the frozen target with trainable LoRA adapters (peft)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if linear_weights(model) != "native":
        raise HeadwayError(
            f"Medusa-2's LoRA adapts the target's linear layers, which target.linear_weights="
            f"{linear_weights(model)} packs for inference: train with target.linear_weights=native"
        )
    try:
        return get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                bias="none",
            ),
        )
    except ValueError as e:
        raise HeadwayError(
            f"head.medusa.lora.target_modules {list(lora.target_modules)} do not fit this target: {e}"
        ) from None


def adapter_state(model: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def kind_config(head: HeadConfig, num_layers: int) -> Any:
    """The head kind's config (the `head` section's own) with defaults resolved for this target
    (EAGLE-3's feature layers: they are saved with the head)."""
    return head_kind(head.kind).for_target(head.kind_config(), num_layers)


def heads_from(head: HeadConfig, init_from: str, target: Any) -> Any:
    """The head of train.init_from, checked against the run's `head` section: same kind, same target
    (load_head refuses another) and the same shape-defining settings; its training-only settings are
    the run's."""
    path = Path(init_from).expanduser()
    kind = read_head_config(path).get("kind")
    if kind != head.kind:
        raise HeadwayError(
            f"train.init_from={path} holds a '{kind}' head, but this run trains head.kind="
            f"{head.kind}: start from a {head.kind} head, or unset train.init_from"
        )
    heads = load_head(path, target.fingerprint, device=target.device, dtype=torch.float32)
    run_cfg = kind_config(head, int(text_config(target.config).num_hidden_layers))
    free = getattr(type(run_cfg), "training_fields", ())
    added = [
        name
        for name in getattr(type(run_cfg), "added_fields", ())
        if getattr(run_cfg, name) != getattr(heads.cfg, name)
        and getattr(heads.cfg, name) == getattr(type(run_cfg)(), name)
    ]
    differ = [
        f.name
        for f in fields(run_cfg)
        if f.name not in (*free, *added) and getattr(run_cfg, f.name) != getattr(heads.cfg, f.name)
    ]
    if added and not differ:  # the head, with the parts these settings add at their initial weights
        heads = with_added_parts(
            heads, replace(heads.cfg, **{k: getattr(run_cfg, k) for k in added})
        )
        log.info(
            "train.init_from: %s start at their initial weights",
            ", ".join(f"head.{kind}.{k}" for k in added),
        )
    if differ:
        shown = ", ".join(f"{k}={getattr(heads.cfg, k)!r}" for k in differ)
        raise HeadwayError(
            f"train.init_from={path} was trained with head.{kind}: {shown}, which this run sets "
            f"otherwise: set those to the head's values, or unset train.init_from"
        )
    heads.cfg = replace(heads.cfg, **{k: getattr(run_cfg, k) for k in free})
    heads.attach_target(target.model)
    log.info("starting from the weights of %s", path)
    return heads.train()


def with_added_parts(heads: Any, cfg: Any) -> Any:
    """`heads` rebuilt under `cfg`, which adds parts (EAGLE-3.1's norms): every weight of `heads`
    kept, the added ones at their initial values."""
    spec = head_kind(heads.kind)
    layer_config = getattr(heads, "layer_config", None)
    grown = spec.build(cfg, heads.hidden_size, heads.vocab_size, heads.d2t, layer_config).to(
        heads.d2t.device
    )
    missing, unexpected = grown.load_state_dict(heads.state_dict(), strict=False)
    fresh = set(grown.state_dict()) - set(heads.state_dict())
    if unexpected or set(missing) != fresh:
        raise HeadwayError(
            f"internal: {cfg} does not only add parts to the head ({unexpected or missing})"
        )
    return grown


def build_heads(
    head: HeadConfig,
    init_from: Optional[str],
    target: Any,
    train_samples: list,
    d2t: Optional[torch.Tensor] = None,
) -> Any:
    """A fresh head of the `head` section for the target (or train.init_from's); a reduced
    vocabulary is `d2t` when given (a trained head's, rebuilt: no pass over the samples) or else the
    most frequent tokens the target wrote (in `train_samples`)."""
    if init_from:
        return heads_from(head, init_from, target)
    kind, spec = head.kind, head_kind(head.kind)
    text = text_config(target.config)
    hidden, vocab, num_layers = (
        int(text.hidden_size),
        int(text.vocab_size),
        int(text.num_hidden_layers),
    )
    kind_cfg = kind_config(head, num_layers)
    if not spec.reduced_vocab(kind_cfg):
        d2t = None
    elif d2t is not None:
        d2t = d2t.detach().cpu()
    else:
        size = kind_cfg.draft_vocab_size
        if size > vocab:
            if (
                size != type(kind_cfg)().draft_vocab_size
            ):  # the default fits most targets; a value set by hand must fit
                raise HeadwayError(
                    f"head.{kind}.draft_vocab_size={size} is larger than the target's vocabulary "
                    f"({vocab} tokens): set it to at most {vocab}"
                )
            size = vocab
        freq = token_frequencies(train_samples, vocab)
        d2t = torch.sort(torch.topk(freq, size).indices).values
        covered = float(freq[d2t].sum()) / max(1, int(freq.sum()))
        log.info(
            "draft vocabulary: %d tokens cover %.1f%% of the target's training tokens",
            size,
            100 * covered,
        )
    layer_config = draft_layer_config(target.config, kind_cfg.draft_layer) if spec.layered else None
    heads = spec.build(kind_cfg, hidden, vocab, d2t=d2t, layer_config=layer_config)
    heads.init_from_target(target.model)
    heads.attach_target(target.model)
    return heads


def copied_target_layers(head: HeadConfig, init_from: Optional[str]) -> Callable[[Any], list[int]]:
    """The target decoder layers a fresh head copies when built (EAGLE-3's head.eagle3.init_layer),
    as a function of the target's config: what a target loaded without its layers (training from
    cached features, target/partial.py) must still hold; none for a head from train.init_from
    (loaded, not copied)."""

    def layers(config: Any) -> list[int]:
        if init_from:
            return []
        index = getattr(
            kind_config(head, int(text_config(config).num_hidden_layers)), "init_layer", -1
        )
        return [index] if isinstance(index, int) and index >= 0 else []

    return layers


def feature_layers(head: HeadConfig, target: Any) -> list[int]:
    """The target hidden states a step needs: the head's own (from the `head` section, as
    build_heads resolves them), plus the last one (the target's logits)."""
    num_layers = int(text_config(target.config).num_hidden_layers)
    module = head_kind(head.kind).module
    return sorted(
        set(module.feature_layers(kind_config(head, num_layers), num_layers)) | {num_layers}
    )
