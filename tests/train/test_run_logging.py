"""Run logs: every record in log.jsonl; wandb gets the same records when configured, and its absence
or failure never stops training (one warning)."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

from headway.train.config import LoggingConfig
from headway.train.logging import RunLogger


class FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, record: dict, step: int) -> None:
        self.logged.append((record, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_gets_every_record_with_its_step(tmp_path: Path, monkeypatch):
    runs: list[FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = RunLogger(
        tmp_path / "log.jsonl",
        LoggingConfig(wandb_project="p", wandb_run_name="r"),
        {"train": {"lr": 1}},
    )
    logger.log({"step": 1, "loss": 2.5})
    logger.log({"step": 2, "eval/loss": 2.0})
    logger.close()
    (run,) = runs
    assert run.init == {"project": "p", "name": "r", "config": {"train": {"lr": 1}}}
    assert (
        run.logged == [({"step": 1, "loss": 2.5}, 1), ({"step": 2, "eval/loss": 2.0}, 2)]
        and run.finished
    )
    assert [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()] == [
        r for r, _ in run.logged
    ]


def test_training_goes_on_without_wandb_and_says_so_once(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING, logger="headway"):
        logger = RunLogger(tmp_path / "log.jsonl", LoggingConfig(wandb_project="p"), {})
        for step in range(3):
            logger.log({"step": step, "loss": 1.0})
        logger.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "wandb is not installed" in warnings[0]
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3


def test_wandb_that_cannot_start_is_reported_once(tmp_path: Path, monkeypatch, caplog):
    def broken(**kw):
        raise RuntimeError("no network")

    fake = types.ModuleType("wandb")
    fake.init = broken
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with caplog.at_level(logging.WARNING, logger="headway"):
        logger = RunLogger(tmp_path / "log.jsonl", LoggingConfig(wandb_project="p"), {})
        logger.log({"step": 1, "loss": 1.0})
        logger.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and "no network" in warnings[0] and "WANDB_MODE=offline" in warnings[0]
    )
