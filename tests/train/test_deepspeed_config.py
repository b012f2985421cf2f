"""DeepSpeed configs: the shipped files are the presets, "auto" fields come from train.*, and a
config that contradicts the run is refused by name (no DeepSpeed needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headway.errors import HeadwayError
from headway.train.config import TrainConfig
from headway.train.deepspeed_engine import resolve_config, zero_preset
from tests.helpers import ROOT_DIR

CONFIGS = ROOT_DIR / "configs" / "deepspeed"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_files_are_the_presets(stage: int):
    assert json.loads((CONFIGS / f"zero{stage}.json").read_text()) == zero_preset(stage)


def test_auto_fields_come_from_the_run():
    tc = TrainConfig(micro_batch_size=3, grad_accum=5, grad_clip=0.5)
    cfg = resolve_config(str(CONFIGS / "zero2.json"), tc, world_size=4, bf16=True)
    assert (
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
        cfg["train_batch_size"],
    ) == (3, 5, 60)
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 2
    assert resolve_config("zero3", tc, 1, bf16=False)["bf16"] == {"enabled": False}


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            {"gradient_accumulation_steps": 8},
            r"gradient_accumulation_steps=8 contradicts the run config \(1\)",
        ),
        ({"optimizer": {"type": "Adam"}}, r"remove its \"optimizer\" section"),
        ({"scheduler": {"type": "WarmupLR"}}, r"remove its \"scheduler\" section"),
        ({"fp16": {"enabled": True}}, r"fp16 is not supported"),
        (
            {"bf16": {"enabled": True}},
            r"bf16.enabled=True but train.autocast_dtype resolves to float32",
        ),
    ],
)
def test_a_contradicting_config_is_refused_by_name(tmp_path: Path, edit: dict, message: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**zero_preset(2), **edit}))
    with pytest.raises(HeadwayError, match=message):
        resolve_config(str(path), TrainConfig(), world_size=2, bf16=False)


def test_missing_or_broken_file_is_named(tmp_path: Path):
    with pytest.raises(
        HeadwayError,
        match=r"nope.json does not exist; use a file such as configs/deepspeed/zero2.json",
    ):
        resolve_config(str(tmp_path / "nope.json"), TrainConfig(), 1, False)
    (tmp_path / "bad.json").write_text("{stage: 2")
    with pytest.raises(HeadwayError, match=r"bad.json is not valid JSON"):
        resolve_config(str(tmp_path / "bad.json"), TrainConfig(), 1, False)


def test_lora_with_deepspeed_is_refused():
    from headway.config import load_config
    from headway.run_config import RunConfig

    with pytest.raises(
        HeadwayError, match=r"head.medusa.lora.enabled.*train Medusa-2 with train.backend=ddp"
    ):
        load_config(
            RunConfig,
            None,
            ["train.backend=deepspeed", "head.kind=medusa", "head.medusa.lora.enabled=true"],
        )
    # the setting is Medusa's: another kind trains no adapters, whatever its section says
    load_config(
        RunConfig,
        None,
        ["train.backend=deepspeed", "head.medusa.lora.enabled=true", "head.kind=eagle3"],
    )
