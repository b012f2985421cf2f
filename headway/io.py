"""Atomic file writes: a reader sees the old file or the whole new one, never a torn write."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

from headway.errors import HeadwayError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_prefix(path: Path) -> str:
    """Temp names beside `path`: distinctive, so the stale-temp sweep never touches a user's own
    files."""
    return f".{path.name}.headway-tmp-"


def remove_stale_temps(path: Path) -> None:
    """Remove what a killed writer of `path` left beside it (its temp files and directories)."""
    if not path.parent.is_dir():
        return
    for stale in path.parent.glob(f"{glob.escape(_temp_prefix(path))}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


@contextlib.contextmanager
def disk_full_named(path: Path) -> Iterator[None]:
    """Turn a full disk into one message naming the file; the old file (if any) is untouched."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HeadwayError(
                f"no space left on the device while writing {path}: free some disk space and rerun the "
                "same command (the previous version of the file, if any, is intact)"
            ) from None
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    with disk_full_named(path):
        _atomic_write_bytes(path, data)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside `out`; on success it replaces `out` whole, on error it is
    removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_temp_prefix(out)))
    try:
        with disk_full_named(out):
            yield tmp
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
        tmp.chmod(0o755)
        # move the old one aside first: a kill here leaves it whole under a temp name
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=_temp_prefix(out)))
            os.replace(out, old / "old")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out.parent)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path` for a writer that wants a file name; fsync and rename it on
    success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with disk_full_named(path):
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safetensors_of(tensors: dict) -> dict:
    """Detached, contiguous CPU copies: what safetensors can write."""
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def file_checksums(root: Path, names: list[str]) -> dict[str, dict]:
    """sha256 and size of each named file under `root`: what a manifest records so damage is caught
    on load."""
    return {
        n: {"sha256": sha256_file(root / n), "bytes": (root / n).stat().st_size}
        for n in sorted(names)
    }


def verify_checksums(root: Path, recorded: Optional[dict], what: str, fix: str) -> None:
    """Refuse `root` when a file its manifest lists is missing, truncated or altered; `recorded`
    None = an older directory written without checksums, accepted as is."""
    for name, want in (recorded or {}).items():
        f = root / name
        if not f.is_file():
            raise HeadwayError(f"{what} {root} is missing {name}: {fix}")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise HeadwayError(
                f"{what} {root}: {name} is truncated or damaged ({size} bytes; it was written with "
                f"{want['bytes']}): {fix}"
            )
        if sha256_file(f) != want["sha256"]:
            raise HeadwayError(
                f"{what} {root}: {name} does not match its recorded sha256 (damaged): {fix}"
            )
