"""tuned.json: the tree `headway tune` chose for a head on each machine, and its use by `generate`
and `bench`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from headway.errors import HeadwayError
from headway.inference.config import GPU_HYBRID_MAX_NODES, GPU_TREE
from headway.inference.cost_model import machine_key
from headway.io import atomic_write_json, read_json

log = logging.getLogger("headway")

TUNED_FILENAME = "tuned.json"


def read_tuned(head_dir: str | Path) -> list[dict]:
    path = Path(head_dir) / TUNED_FILENAME
    if not path.is_file():
        return []
    try:
        entries = read_json(path)["entries"]
    except (ValueError, KeyError, TypeError):
        raise HeadwayError(
            f"{path} is not a tuned-tree file: delete it and run `headway tune --head {head_dir}` again"
        ) from None
    return entries if isinstance(entries, list) else []


def save_tuned(head_dir: str | Path, entry: dict) -> Path:
    """Add this machine's entry to tuned.json (replacing an older one for the same machine)."""
    entries = [e for e in read_tuned(head_dir) if e.get("machine") != entry["machine"]] + [entry]
    path = Path(head_dir) / TUNED_FILENAME
    atomic_write_json(path, {"entries": entries})
    return path


def tuned_entry(head_dir: str | Path, model: Any, engine: str) -> Optional[dict]:
    """The head's tuned.json entry for this machine, thread count, dtype and engine, if any."""
    key = machine_key(model, engine)
    return next((e for e in read_tuned(head_dir) if e.get("machine") == key), None)


def apply_tuned(cfg: Any, head_dir: str | Path, model: Any) -> Any:
    """cfg with its tree settings replaced by the head's tuned ones for this machine, if there are
    any (a copy; the caller's config is left as it was)."""
    if not cfg.inference.use_tuned:
        return cfg
    entries = read_tuned(head_dir)
    match = tuned_entry(head_dir, model, cfg.inference.engine)
    if match is None and next(model.parameters()).device.type == "cuda":
        log.info(
            "no tree tuned for this GPU: using GPU-sized trees (%s; run `headway tune`)", GPU_TREE
        )
        return gpu_sized(cfg)
    if match is None:
        if entries:
            log.info(
                "%s/%s has no tuned tree for this machine (%s); "
                "using the configured tree (run `headway tune`)",
                head_dir,
                TUNED_FILENAME,
                machine_key(model, cfg.inference.engine),
            )
        return cfg
    chosen = match["chosen"]["inference"]
    log.info(
        "using the tree `headway tune` chose for this machine: "
        "%s (inference.use_tuned=false for the configured one)",
        chosen,
    )
    return dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, **chosen))


def gpu_sized(cfg: Any) -> Any:
    """cfg with the GPU-sized trees (config.GPU_TREE, GPU_HYBRID_MAX_NODES) in place of its tree
    settings."""
    hybrid = dataclasses.replace(cfg.inference.hybrid, max_nodes=GPU_HYBRID_MAX_NODES)
    return dataclasses.replace(
        cfg, inference=dataclasses.replace(cfg.inference, **GPU_TREE, hybrid=hybrid)
    )
