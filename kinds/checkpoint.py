"""Native head directories: config.json + model.safetensors, tied to one target by its fingerprint."""

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
    """Write the head directory whole or not at all (temp dir, then rename); `write_extra` adds files
    (Medusa-2's LoRA adapter) to the temp dir before the rename."""
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
    """The head a saved config (kind, sizes, draft_layer) and its `head` section describe, holding `state`; a
    state that does not fit is an error that starts with `mismatch` and names the keys."""
    kind = config["kind"]
    if config.get("adapted_target") and head_kind(kind).adapts_target and "lora" not in head_section:
        # a Medusa-2 head saved before its LoRA settings were a head setting (head.medusa.lora) said so
        # only here
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
    path: str | os.PathLike, fingerprint: Optional[dict] = None, device: Any = "cpu", dtype: Any = None
) -> Any:
    """Build the head a directory describes; refuse one made for another target (naming both)."""
    p = Path(path)
    config = read_head_config(p)
    kind = config.get("kind")
    if kind not in KINDS:
        raise HeadwayError(f"{p}: unknown head kind '{kind}' (this headway knows {', '.join(KINDS)})")
    if fingerprint is not None:
        diff = fingerprint_mismatch(config.get("target_fingerprint", {}), fingerprint)
        if diff:
            raise HeadwayError(
                f"head {p} was made for target {config.get('target_fingerprint', {}).get('id')} but the "
                f"loaded target is {fingerprint.get('id')} ({'; '.join(diff)}): use the head's own target"
            )
    verify_checksums(p, config.get("files"), "head", "the file is damaged; copy or export the head again")
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
    return heads.to(device=device, dtype=dtype).eval()  # dtype casts floating tensors only: d2t stays int64
