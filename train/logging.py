"""Run logs: JSON lines always; wandb when configured (offline mode works), never required."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from headway.io import atomic_write_text

log = logging.getLogger("headway")


def _step_of(line: str) -> float:
    """A record's step; a line cut short by a kill counts as after every step (it is dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return float("inf")


class RunLogger:
    """`resume_step`: continuing a run from that step's checkpoint; records of later steps (written
    before the run was killed, and about to be redone) are dropped, so the log holds each step
    once."""

    def __init__(self, path: Path, cfg: Any, run_cfg: Any, resume_step: int | None = None):
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resume_step]
            atomic_write_text(path, "".join(f"{line}\n" for line in kept))
        self.file = open(path, "a" if resume_step is not None else "w")
        self.wandb = None
        if cfg.wandb_project:
            try:
                import wandb

                config = asdict(run_cfg) if is_dataclass(run_cfg) else dict(run_cfg)
                self.wandb = wandb.init(
                    project=cfg.wandb_project, name=cfg.wandb_run_name, config=config
                )
            except ImportError:
                log.warning(
                    "logging.wandb_project is set but wandb is not installed (pip install 'headway[wandb]'); "
                    "logging to %s only",
                    path,
                )
            except Exception as e:  # wandb raises its own types for network and auth problems
                log.warning(
                    "wandb could not start (%s); logging to %s only (WANDB_MODE=offline works offline)",
                    e,
                    path,
                )

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record.get("step"))

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
