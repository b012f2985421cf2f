"""`headway export`: a native head directory in, an engine's draft checkpoint out, checked key by
key.

The exporter converts, checks the result against the engine's layout (refusing to write what the
engine would reject or misread), writes it atomically, then reads the files back, checks them again
and rebuilds the native head from them: the round trip must give the same tensors. The Headway
metadata an engine ignores (head kind, its config, the target fingerprint) rides along under the
"headway" key, so an export can be re-imported (`load_export`) and used by `headway generate`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from headway.errors import HeadwayError
from headway.export.layouts import LAYOUTS, REFUSED, Converter
from headway.export.layouts.common import restore_rope
from headway.export.schema import check, to_dtype
from headway.faults import fault_point
from headway.io import atomic_dir, file_checksums, safetensors_of, verify_checksums
from headway.kinds.checkpoint import load_head, rebuild_head, write_head_config
from headway.kinds.head_dir import read_head_config, resolve_head_dir
from headway.kinds.registry import head_kind
from headway.runtime import parse_dtype
from headway.target.loading import fingerprint_mismatch

log = logging.getLogger("headway")

FORMATS = ["native", "vllm", "sglang", "trtllm", "speculators", "gguf"]
# Native config keys carried in an export's config.json (under "headway") so it can be re-imported.
CARRIED = (
    "kind",
    "headway_version",
    "hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "head",
    "draft_layer",
    "target_fingerprint",
    "rank_accuracy",
    "trained_steps",
)


def export_head(
    head_dir: str | os.PathLike,
    fmt: str,
    out: str | os.PathLike,
    dtype: str = "bfloat16",
    target_fingerprint: Optional[dict] = None,
    target_lm_head: Optional[torch.Tensor] = None,
    verifier: str = "",
    verifier_arch: str = "LlamaForCausalLM",
    num_draft_tokens: Optional[int] = None,
    tokenizer: Any = None,
) -> Path:
    """Write a head in an engine's layout, checked key by key against what that engine's loader
    reads.

    Args:
        head_dir: a head directory, or a training run's directory (its head/).
        fmt: native, vllm, sglang, trtllm, speculators or gguf (llama.cpp).
        out: the directory to write (whole or not at all).
        dtype: the floating weights' dtype.
        target_fingerprint: refuse a head made for another target than this one.
        target_lm_head: [V, h], the target's lm_head, for Medusa heads that read out through it.
        verifier, verifier_arch: speculators only: the target directory (or hub id) `vllm serve`
            runs the draft with, and its architecture.
        num_draft_tokens: speculators only: the draft length written for vLLM (default: sized from
            the head).
        tokenizer: gguf only: the target's tokenizer, which llama.cpp loads with the draft.
    Returns:
        `out`.
    """
    if fmt not in FORMATS:
        raise HeadwayError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    head_dir, out = resolve_head_dir(head_dir), Path(out)
    if out.resolve() == head_dir.resolve():
        raise HeadwayError(f"--out {out} is the head directory itself: choose another directory")
    native = read_head_config(head_dir)
    # a damaged or mismatched head stops here, named
    heads = load_head(head_dir, target_fingerprint)
    if native.get("adapted_target"):
        raise HeadwayError(
            f"{head_dir} is a Medusa-2 head: its output is the LoRA-adapted target's, which engines do "
            "not load with the draft; merge the adapter into the target first, or use Medusa-1"
        )
    if fmt == "native":
        return _export_native(head_dir, out, heads, dtype)
    conv = converter(fmt, native["kind"])
    state = {k: v.detach().cpu() for k, v in heads.state_dict().items()}
    if needs_target_lm_head(native) and target_lm_head is not None:
        state["target.lm_head.weight"] = target_lm_head.detach().cpu()
    config, tensors = conv.to_engine(
        native,
        state,
        verifier=verifier,
        verifier_arch=verifier_arch,
        draft_tokens=num_draft_tokens or draft_tokens(native),
        tokenizer=tokenizer,
    )
    config["headway"] = {
        "format": fmt,
        **{k: native[k] for k in CARRIED if k in native},
        "head": asdict(heads.cfg),
    }
    layout = conv.layout
    if layout.write is None:  # an engine with its own file format casts as its own converter does
        tensors = to_dtype(tensors, parse_dtype(dtype))
    check(layout, config, tensors, f"the {fmt} export of {head_dir}")
    weights = layout.weights_file
    with atomic_dir(out) as tmp:
        if layout.write is None:
            save_file(tensors, str(tmp / weights), metadata={"format": "pt"})
        else:
            layout.write(tmp / weights, config, tensors, parse_dtype(dtype))
        config["headway"]["files"] = file_checksums(tmp, [weights])
        # a file holding its own keys (GGUF) leaves config.json only Headway's section
        sidecar = config if layout.read is None else {"headway": config["headway"]}
        (tmp / "config.json").write_text(json.dumps(sidecar, indent=2) + "\n")
        fault_point("export:written")
        for f in tmp.iterdir():
            f.chmod(0o644)  # engines often run as another user
        _read_back(tmp, heads, dtype)
    log.info(
        "%s: %s head written in the %s layout (%s)", out, native["kind"], fmt, conv.layout.engines
    )
    return out


def converter(fmt: str, kind: str) -> Converter:
    """The kind's converter for an engine format; a format the kind cannot be served in is refused
    with why."""
    head_kind(kind)  # an unknown kind is refused with the known ones
    if fmt in REFUSED[kind]:
        raise HeadwayError(REFUSED[kind][fmt])
    if fmt not in LAYOUTS[kind]:
        raise HeadwayError(
            f"no {fmt} layout for a '{kind}' head (its formats: native, {', '.join(LAYOUTS[kind])})"
        )
    return LAYOUTS[kind][fmt]


def draft_tokens(native: dict) -> int:
    """The draft length an engine should run the head with (the kind's: Medusa's head count,
    EAGLE-3's trained unroll, 3 for EAGLE-1)."""
    return head_kind(native.get("kind")).draft_tokens(native.get("head", {}))


def needs_target_lm_head(native: dict) -> bool:
    """A head that reads out through the target's own lm_head (Medusa's shared): engines load it
    with the draft."""
    return head_kind(native.get("kind")).reads_target_lm_head(native.get("head", {}))


def _export_native(head_dir: Path, out: Path, heads: Any, dtype: str) -> Path:
    """The head directory as it is (tuned.json, a LoRA adapter included), its weights cast to
    `dtype`."""
    with atomic_dir(out) as tmp:
        for name in os.listdir(head_dir):
            src = head_dir / name
            if name != "model.safetensors":
                (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / name)
        tensors = to_dtype(
            {k: v.detach().cpu() for k, v in heads.state_dict().items()}, parse_dtype(dtype)
        )
        save_file(
            safetensors_of(tensors),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt", "kind": heads.kind},
        )
        write_head_config(tmp, {k: v for k, v in read_head_config(tmp).items() if k != "files"})
        fault_point("export:written")
        _read_back(tmp, heads, dtype)
    return out


def _read_back(directory: Path, heads: Any, dtype: str) -> None:
    """The files on disk rebuild the same head (at the export dtype), or nothing is written."""
    again = load_export(directory)
    want = {
        k: (v.to(parse_dtype(dtype)) if v.is_floating_point() else v)
        for k, v in heads.state_dict().items()
    }
    got = again.state_dict()
    bad = [k for k in want if k not in got or not torch.equal(got[k].to(want[k].dtype), want[k])]
    if bad:
        raise HeadwayError(
            f"internal: the export does not read back to the same head ({', '.join(bad[:5])})"
        )


def read_export(directory: str | os.PathLike) -> tuple[str, dict, dict]:
    """(format, config, tensors) of an exported directory, checked against its engine layout."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise HeadwayError(
            f"{d} has no config.json: not an exported head (export one with `headway export`)"
        )
    try:
        config = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HeadwayError(f"{d / 'config.json'} is not valid JSON ({e})") from None
    meta = config.get("headway")
    if not isinstance(meta, dict) or "format" not in meta or "kind" not in meta:
        raise HeadwayError(
            f"{d / 'config.json'} has no 'headway' section: it was not written by `headway export`"
        )
    layout = converter(meta["format"], meta["kind"]).layout
    weights = d / layout.weights_file
    if not weights.is_file():
        raise HeadwayError(
            f"{d} has no {layout.weights_file}, which {layout.name} loads: export the head again"
        )
    verify_checksums(d, meta.get("files"), "export", "the file is damaged; export the head again")
    if layout.read is not None:  # the engine's own file holds its keys
        keys, tensors = layout.read(weights)
        config = {**keys, "headway": meta}
    else:
        try:
            tensors = load_file(str(weights))
        except Exception as e:
            raise HeadwayError(
                f"cannot read {weights} ({e}): the file is truncated or damaged; export again"
            ) from None
    check(layout, config, tensors, str(d))
    return meta["format"], config, tensors


def load_export(directory: str | os.PathLike, fingerprint: Optional[dict] = None) -> Any:
    """Rebuild the native head from an engine export (float32 unless the export's dtype is kept).

    Args:
        directory: an export written by `export_head` (any format), or a native head directory.
        fingerprint: refuse an export made for another target than this one.
    Returns:
        The head module (eval mode), its weights equal to the export's."""
    d = Path(directory)
    if (d / "config.json").is_file() and "headway" not in json.loads(
        (d / "config.json").read_text() or "{}"
    ):
        return load_head(d, fingerprint)  # a native head directory
    fmt, config, tensors = read_export(d)
    meta = config["headway"]
    if fingerprint is not None:
        diff = fingerprint_mismatch(meta.get("target_fingerprint", {}), fingerprint)
        if diff:
            raise HeadwayError(
                f"export {d} was made for another target ({'; '.join(diff)}): use the head's own target"
            )
    kind = meta["kind"]
    conv = converter(fmt, kind)
    state = conv.from_engine(config, tensors)
    head_cfg = {**meta["head"], **conv.head_settings(config)}
    if isinstance(meta.get("draft_layer"), dict):  # the RoPE the engine reads is the one it serves
        meta = {**meta, "draft_layer": restore_rope(meta["draft_layer"], config, fmt)}
    return rebuild_head(meta, head_cfg, state, f"{d} does not rebuild its head").eval()


def serve_hint(fmt: str, config: dict, out: Path) -> str:
    """How to run the export in its engine (printed by the CLI), sized from the head."""
    meta = config.get("headway", {})
    if fmt == "native":
        return f"headway generate --head {out}"
    return converter(fmt, meta.get("kind")).serve(out, config, draft_tokens(meta))
