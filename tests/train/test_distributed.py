"""Training with several processes (torchrun, gloo, 2 processes x 1 thread): the same curve as one
process with the same effective batch, and a killed run resumes where it stopped.

Tolerance: the ranks' gradients are summed by an all-reduce instead of one process's accumulation,
    so
float32 sums run in another order (relative error ~1e-7 per step); after a few AdamW steps the
losses agree to ~1e-6. rel=1e-4 leaves room for that and still fails on any real difference in data,
batch or averaging (those move the loss by 1e-2 or more here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from headway.errors import HeadwayError
from tests.helpers.train_helpers import losses, small_run, small_run_args

HEADS = {
    "medusa": ("head.kind=medusa", "head.medusa.num_heads=2"),
    "eagle3": ("head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=2"),
}


def overrides(model_dir: Path, data: Path, out: Path, kind: str, *extra: str) -> list[str]:
    """small_run's settings as command-line overrides: 6 steps of 2 sequences per rank x 2
    accumulation."""
    return small_run_args(model_dir, data, out, *HEADS[kind], *extra)


def torchrun(args: list[str], kill_at: str | None = None) -> subprocess.CompletedProcess:
    # every collective called through torch.distributed is checked to get tensors on the training
    # device
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HEADWAY_CHECK_COLLECTIVES": "1"}
    env.pop("HEADWAY_KILL_AT", None)
    if kill_at:
        env["HEADWAY_KILL_AT"] = kill_at
    cmd = [sys.executable, "-m", "headway", "train", "--nproc", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


DEEPSPEED = pytest.param(
    "deepspeed",
    "eagle3",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed not installed (pip install -e '.[dev]')",
    ),
)


@pytest.mark.parametrize("backend,kind", [("ddp", "medusa"), ("fsdp", "eagle3"), DEEPSPEED])
def test_two_processes_follow_the_one_process_curve_and_resume(
    tiny_dirs, tiny_data, tmp_path: Path, backend: str, kind: str
):
    from headway.train.loop import train

    model = tiny_dirs["llama"]
    train(small_run(model, tiny_data, tmp_path / "one", *HEADS[kind], "train.grad_accum=4"))
    one = losses(tmp_path / "one")

    res = torchrun(overrides(model, tiny_data, tmp_path / "two", kind, f"train.backend={backend}"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "effective batch: 8 sequences (2 per rank x 2 accumulation x 2 ranks)" in res.stderr
    # the collectives the run made (losses, metrics, checkpoints; FSDP's and DeepSpeed's own) all
    # had their tensors on the training device
    checked = re.search(
        r"HEADWAY_CHECK_COLLECTIVES: every collective's tensors were on cpu \((.*)\)", res.stderr
    )
    assert checked and "all_reduce x" in checked.group(1), res.stderr[-3000:]
    two = losses(tmp_path / "two")
    assert [s for s, _ in two] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(one, two):
        assert b == pytest.approx(a, rel=1e-4)
    evals = [
        json.loads(line)
        for line in (tmp_path / "two" / "log.jsonl").read_text().splitlines()
        if "eval/loss" in line
    ]
    assert len(evals) == 2 and (tmp_path / "two" / "head" / "config.json").is_file()

    killed = torchrun(
        overrides(model, tiny_data, tmp_path / "cut", kind, f"train.backend={backend}"),
        "checkpoint:3",
    )
    assert killed.returncode != 0 and not (tmp_path / "cut" / "head").exists()
    shutil.copytree(tmp_path / "cut", tmp_path / "cut-alone")
    res = torchrun(
        overrides(
            model,
            tiny_data,
            tmp_path / "cut",
            kind,
            f"train.backend={backend}",
            "train.resume_from=auto",
        )
    )
    assert res.returncode == 0, res.stderr[-3000:]
    cut = losses(tmp_path / "cut")
    # steps 1-3 before the kill, 4-6 after: each once
    assert [s for s, _ in cut] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in cut] == pytest.approx([v for _, v in two], rel=1e-6)

    alone = small_run(
        model,
        tiny_data,
        tmp_path / "cut-alone",
        *HEADS[kind],
        "train.grad_accum=4",
        "train.resume_from=auto",
    )
    if backend == "deepspeed":  # ZeRO shards are per rank: another world size is refused, by name
        with pytest.raises(
            HeadwayError,
            match="written by train.backend=deepspeed: resume it with train.backend=deepspeed "
            "and 2 processes",
        ):
            train(alone)
        # ZeRO-3 with the chunked vocabulary loss (CUDA's default): the objective reads the
        # partitioned lm_head weight directly, not through its forward (review finding 13); the same
        # curve
        args = ("train.backend=deepspeed", "train.deepspeed_config=zero3", "train.loss_chunk=16")
        res = torchrun(
            overrides(model, tiny_data, tmp_path / "zero3", kind, *args, "train.save_every=0")
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert [v for _, v in losses(tmp_path / "zero3")] == pytest.approx(
            [v for _, v in one], rel=1e-4
        )
        return
    # the same checkpoint resumed by one process (same effective batch): another world size, same
    # curve
    train(alone)
    assert [v for _, v in losses(tmp_path / "cut-alone")] == pytest.approx(
        [v for _, v in two], rel=1e-4
    )


def test_a_sharded_target_gives_the_replicated_curve(tiny_dirs, tiny_data, tmp_path: Path):
    """train.shard_target: the frozen target's decoder layers sharded by FSDP2 across the 2
    ranks."""
    from headway.train.loop import train

    model = tiny_dirs["llama"]
    train(
        small_run(
            model,
            tiny_data,
            tmp_path / "one",
            *HEADS["eagle3"],
            "train.grad_accum=4",
            "train.save_every=0",
        )
    )
    res = torchrun(
        overrides(
            model,
            tiny_data,
            tmp_path / "two",
            "eagle3",
            "train.backend=fsdp",
            "train.shard_target=true",
            "train.save_every=0",
        )
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "decoder layers sharded across 2 ranks" in res.stderr
    # each rank holds half the decoder layers after a forward (they are freed, not kept gathered)
    # plus the embedding, norm and lm_head: at most half the target plus one layer
    held = re.findall(r"target: rank (\d) holds (\d+) of its (\d+) parameter bytes", res.stderr)
    assert held, res.stderr[-3000:]  # (rank 0 logs; the ranks hold equal shards)
    from headway.target.loading import load_target

    whole = load_target(small_run(model, tiny_data, tmp_path / "x").target).model
    layer = sum(p.numel() * p.element_size() for p in whole.model.layers[0].parameters())
    unsharded = sum(
        p.numel() * p.element_size() for n, p in whole.named_parameters() if ".layers." not in n
    )
    for _, mine, total in held:
        assert int(mine) <= (int(total) - unsharded) / 2 + unsharded + layer
    assert [v for _, v in losses(tmp_path / "two")] == pytest.approx(
        [v for _, v in losses(tmp_path / "one")], rel=1e-4
    )


def test_nproc_needs_a_distributed_backend(tiny_dirs, tiny_data, tmp_path: Path):
    res = torchrun(overrides(tiny_dirs["llama"], tiny_data, tmp_path / "x", "medusa"))
    assert res.returncode == 2 and "--nproc 2 needs a distributed train.backend" in res.stderr


def test_cache_features_in_two_processes_writes_the_one_process_cache(
    tiny_dirs, tiny_data, tmp_path: Path
):
    """Each rank writes every other shard; rank 0's manifest equals one process's, checksums
    included."""
    base = [
        "cache-features",
        f"target.name_or_path={tiny_dirs['llama']}",
        "target.num_threads=1",
        f"train.datasets=[{tiny_data}]",
        "features.shard_size=5",
        "features.layers=[1,4]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "headway", *base, f"features.output_dir={tmp_path / 'one'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "headway",
            *base,
            "--nproc",
            "2",
            f"features.output_dir={tmp_path / 'two'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    assert "cache-features[rank 1]" in two.stderr
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two"))
    assert len(a["shards"]) >= 4 and a == b


def test_shard_target_needs_fsdp():
    from headway.train.config import TrainConfig

    with pytest.raises(
        HeadwayError,
        match="train.shard_target shards the target with FSDP2: set train.backend=fsdp",
    ):
        TrainConfig(shard_target=True, backend="ddp")
