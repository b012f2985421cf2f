"""Native head directories: config.json + model.safetensors, tied to one target by its
fingerprint."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from safetensors.torch import load_file, save_file

import headway
from headway.errors import HeadwayError
from headway.io import atomic_dir, file_checksums, safetensors_of, verify_checksums
from headway.kinds.head_dir import read_head_config
from headway.kinds.registry import KINDS, head_kind
from headway.target.loading import fingerprint_mismatch


def save_head(
    heads: Any,
    out: str | os.PathLike,
    fingerprint: dict,
    extra: Optional[dict] = None,
    write_extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write the head directory whole or not at all (temp dir, then rename); `write_extra` adds
    files (Medusa-2's LoRA adapter) to the temp dir before the rename."""
    out = Path(out)
    config = {
        "kind": heads.kind,
        "headway_version": headway.__version__,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "draft_vocab_size": heads.draft_vocab_size,
        "head": asdict(heads.cfg),
        **({"draft_layer": heads.layer_config} if hasattr(heads, "layer_config") else {}),
        "target_fingerprint": fingerprint,
        **(extra or {}),
    }
    with atomic_dir(out) as tmp:
        save_file(
            safetensors_of(heads.state_dict()),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt", "kind": heads.kind},
        )
        if write_extra is not None:
            write_extra(tmp)
        write_head_config(tmp, config)
    return out


def write_head_config(directory: Path, config: dict) -> None:
    """config.json, with the sha256 of every weight file beside it (written last, so it seals
    the directory)."""
    files = file_checksums(directory, [f.name for f in directory.glob("*.safetensors")])
    (directory / "config.json").write_text(json.dumps({**config, "files": files}, indent=2) + "\n")


def saved_head_config(kind: str, saved: dict, state: dict) -> Any:
    """The kind's config from a saved `head` section, with the values older heads had before a
    setting existed."""
    spec = head_kind(kind)
    head_cfg = spec.upgrade(dict(saved), state)
    if spec.layered:  # heads written before draft_layer was a setting have the target's own layer
        head_cfg = {"draft_layer": "target", **head_cfg}
    return spec.config(**head_cfg)


def rebuild_head(config: dict, head_section: dict, state: dict, mismatch: str) -> Any:
    """The head a saved config (kind, sizes, draft_layer) and its `head` section describe, holding
    `state`; a state that does not fit is an error that starts with `mismatch` and names the
    keys."""
    kind = config["kind"]
    if (
        config.get("adapted_target")
        and head_kind(kind).adapts_target
        and "lora" not in head_section
    ):
        # a Medusa-2 head saved before its LoRA settings were a head setting (head.medusa.lora) said
        # so only here
        head_section = {**head_section, "lora": {"enabled": True}}
    heads = head_kind(kind).build(
        saved_head_config(kind, head_section, state),
        config["hidden_size"],
        config["vocab_size"],
        d2t=state.get("d2t"),
        layer_config=config.get("draft_layer"),
    )
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HeadwayError(f"{mismatch}: missing {missing}, unexpected {unexpected}")
    return heads


def load_head(
    path: str | os.PathLike,
    fingerprint: Optional[dict] = None,
    device: Any = "cpu",
    dtype: Any = None,
) -> Any:
    """Build the head a directory describes; refuse one made for another target (naming both)."""
    p = Path(path)
    config = read_head_config(p)
    kind = config.get("kind")
    if kind not in KINDS:
        raise HeadwayError(
            f"{p}: unknown head kind '{kind}' (this headway knows {', '.join(KINDS)})"
        )
    if fingerprint is not None:
        diff = fingerprint_mismatch(config.get("target_fingerprint", {}), fingerprint)
        if diff:
            raise HeadwayError(
                f"head {p} was made for target {config.get('target_fingerprint', {}).get('id')} but the "
                f"loaded target is {fingerprint.get('id')} ({'; '.join(diff)}): use the head's own target"
            )
    verify_checksums(
        p, config.get("files"), "head", "the file is damaged; copy or export the head again"
    )
    try:
        state = load_file(str(p / "model.safetensors"))
    except Exception as e:
        raise HeadwayError(
            f"cannot read {p / 'model.safetensors'} ({e}): the file is damaged; re-export the head"
        ) from None
    if KINDS[kind].layered and not isinstance(config.get("draft_layer"), dict):
        raise HeadwayError(
            f"{p / 'config.json'} has no draft_layer section, which a '{kind}' head needs: re-export it"
        )
    heads = rebuild_head(
        config, config["head"], state, f"{p / 'model.safetensors'} does not match its config"
    )
    # dtype casts floating tensors only: d2t stays int64
    return heads.to(device=device, dtype=dtype).eval()


# the sizes a head's config.json shares with its target's config.json
TARGET_SIZES = ("hidden_size", "vocab_size")


def check_head_shapes(path: str | os.PathLike, target_sizes: Optional[dict] = None) -> None:
    """Refuse, in one line, a head whose config.json disagrees with its own weights (the shapes the
    config builds, on the meta device, against model.safetensors' header) or with its target's sizes
    (`target_sizes`: the target's config.json, e.g. hidden_size and vocab_size), before any weight
    or the target loads.

    Args:
        path: a native head directory; target_sizes: the target's sizes by name (None: not
            checked)."""
    import torch
    from safetensors import safe_open

    p = Path(path)
    config = read_head_config(p)
    kind = config.get("kind")
    if kind not in KINDS or not (p / "model.safetensors").is_file():
        return  # (named where the head loads)
    # the shapes from the header; integer tensors (the draft vocabulary's maps, small) read whole,
    # since a head's build reads their values
    saved, state = {}, {}
    try:
        with safe_open(str(p / "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                part = f.get_slice(k)
                saved[k] = tuple(part.get_shape())
                integer = part.get_dtype().startswith(("I", "U"))
                state[k] = f.get_tensor(k) if integer else torch.empty(saved[k], device="meta")
    except Exception:
        return  # a damaged file is named where the head loads, by its checksum
    try:
        with torch.device("meta"):
            heads = head_kind(kind).build(
                saved_head_config(kind, config["head"], state),
                config["hidden_size"],
                config["vocab_size"],
                d2t=state.get("d2t"),
                layer_config=config.get("draft_layer"),
            )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise HeadwayError(
            f"{p / 'config.json'} does not describe a '{kind}' head ({type(e).__name__}: {e}): restore the "
            "config.json that came with these weights, or export the head again"
        ) from None
    wrong = [
        (key, tuple(t.shape), saved[key])
        for key, t in heads.state_dict().items()
        if key in saved and tuple(t.shape) != saved[key]
    ]
    if wrong:
        key, expected, actual = wrong[0]
        # the config's fields that give a size the weights do not have, over every mismatched tensor
        fields = _fields_of(config, {d for _, e, a in wrong for d in e if d not in a})
        said = f" (config.json: {', '.join(fields)})" if fields else ""
        raise HeadwayError(
            f"{p / 'config.json'} disagrees with its weights: {key} is {list(actual)} in model.safetensors "
            f"but {list(expected)} by the config{said}: restore the config.json that came with these "
            "weights, or export the head again"
        )
    for name in TARGET_SIZES:
        want = (target_sizes or {}).get(name)
        if want is not None and config.get(name) is not None and config[name] != want:
            raise HeadwayError(
                f"{p / 'config.json'} says {name}={config[name]}, but the target has {name}={want}: use the "
                "head's own target, or restore the config.json that came with these weights"
            )


def _fields_of(config: dict, values: set) -> list[str]:
    """The config's numeric fields (top level, `head`, `draft_layer`) whose value is one of
    `values`."""
    found = []
    for prefix, section in (
        ("", config),
        ("head.", config.get("head")),
        ("draft_layer.", config.get("draft_layer")),
    ):
        if isinstance(section, dict):
            for k, v in section.items():
                if isinstance(v, int) and not isinstance(v, bool) and v in values:
                    found.append(f"{prefix}{k}={v}")
    return found
