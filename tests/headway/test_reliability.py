"""Reliability: runs killed with SIGKILL at named points finish on a rerun with nothing lost or
duplicated; damaged files are named, not loaded; bad input gets one message; untrusted files run no
code; memory stays flat over a long prompt set. docs/reliability.md lists each case and the test
that tries it."""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.data_scripts.distill import distill, load_distilled
from headway.errors import HeadwayError
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.generate import speculative_generate
from headway.io import atomic_write_json, atomic_write_text
from headway.kinds.checkpoint import load_head, save_head
from headway.prompts import load_conversations
from headway.run_config import RunConfig
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from headway.train.checkpointing import latest_checkpoint, read_checkpoint
from tests.helpers.decode_helpers import chat_ids
from tests.helpers.train_helpers import losses, small_run, small_run_args
from tests.kinds.test_eagle import random_head

EAGLE3 = ("head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=2")


def headway(
    *args: str, kill_at: str | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HEADWAY_KILL_AT", None)
    if kill_at:
        env["HEADWAY_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "headway", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def killed(res: subprocess.CompletedProcess) -> bool:
    return res.returncode == -signal.SIGKILL


def leftovers(root: Path) -> list[str]:
    """Temp files and directories a writer leaves behind (every Headway temp name starts with
    '.')."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def flip_byte(path: Path) -> None:
    """Damage a file without changing its size: only a checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def train_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """small_run's settings on the command line, with an EAGLE-3 head."""
    return small_run_args(model, data, out, *EAGLE3, *extra)


# ---- faults: SIGKILL, then the same command again ----


def distill_args(model: Path, prompts: Path, out: Path) -> list[str]:
    return [
        f"target.name_or_path={model}",
        "target.device=cpu",
        "target.num_threads=1",
        f"prompts.path={prompts}",
        f"distill.output_dir={out}",
        "distill.engine=hf",
        "distill.max_new_tokens=10",
        "distill.chunk_size=3",
        "distill.batch_size=3",
    ]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"instruction": f"Item {i}: say {i} twice."}) + "\n" for i in range(9))
    )
    return path


@pytest.mark.parametrize("kill_at", ["distill:chunk:1", "distill:merged"])
def test_distill_killed_then_rerun_gives_the_clean_dataset(
    tiny_dirs, prompts_file: Path, tmp_path: Path, kill_at: str
):
    args = distill_args(tiny_dirs["llama"], prompts_file, tmp_path / "d")
    first = headway("distill", *args, kill_at=kill_at)
    assert killed(first), first.stderr[-2000:]
    assert not (tmp_path / "d" / "manifest.json").exists()
    assert headway("distill", *args).returncode == 0
    ds, manifest = load_distilled(tmp_path / "d")
    ref = load_config(
        RunConfig, None, distill_args(tiny_dirs["llama"], prompts_file, tmp_path / "clean")
    )
    clean, _ = load_distilled(distill(ref.target, ref.prompts, ref.distill, ref.magpie))
    assert ds["id"] == list(range(9))  # every prompt once
    assert ds["input_ids"] == clean["input_ids"] and ds["loss_mask"] == clean["loss_mask"]
    assert (
        set(manifest["files"]) >= {"dataset_info.json", "state.json"}
        and leftovers(tmp_path / "d") == []
    )


@pytest.fixture(scope="module")
def clean_run(tiny_dirs, tiny_data, tmp_path_factory) -> Path:
    """The reference: the same training command, never interrupted (run as a command, timed)."""
    out = tmp_path_factory.mktemp("clean") / "run"
    start = time.time()
    res = headway("train", *train_args(tiny_dirs["llama"], tiny_data, out))
    assert res.returncode == 0, res.stderr[-3000:]
    (out / "seconds").write_text(str(time.time() - start))
    return out


@pytest.mark.parametrize("kill_at", ["checkpoint-writing:3", "checkpoint:3"])
def test_train_killed_at_a_checkpoint_resumes_the_same_curve(
    tiny_dirs, tiny_data, clean_run: Path, tmp_path: Path, kill_at: str
):
    args = train_args(tiny_dirs["llama"], tiny_data, tmp_path / "run")
    assert killed(headway("train", *args, kill_at=kill_at))
    step3 = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert step3.is_dir() == (
        kill_at == "checkpoint:3"
    )  # killed mid-write: no half checkpoint under the real name
    res = headway("train", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]  # each step logged once
    assert [v for _, v in losses(tmp_path / "run")] == pytest.approx(
        [v for _, v in losses(clean_run)], rel=1e-6
    )
    # the totals carry over the resume: the same answer tokens at every step, and wall time that
    # only grows
    resumed, clean = training_rows(tmp_path / "run"), training_rows(clean_run)
    assert [r["answer_tokens"] for r in resumed] == [r["answer_tokens"] for r in clean]
    assert resumed[0]["answer_tokens"] > 0
    walls = [r["wall_seconds"] for r in resumed]
    assert walls == sorted(walls) and walls[3] >= walls[2]
    assert leftovers(tmp_path / "run") == []


def training_rows(run: Path) -> list[dict]:
    """The log's training records (evaluations are logged under the same step), in order."""
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_train_killed_at_a_random_moment_resumes_the_same_curve(
    tiny_dirs, tiny_data, clean_run: Path, tmp_path: Path
):
    rng = random.Random(int(os.environ.get("HEADWAY_FAULT_SEED", "10")))
    seconds = float((clean_run / "seconds").read_text())
    args = ["-m", "headway", "train", *train_args(tiny_dirs["llama"], tiny_data, tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(rng.uniform(0.5, 0.95) * seconds)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = headway("train", *args[3:])
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [s for s, _ in losses(tmp_path / "run")]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6] and steps == sorted(steps)
    assert [v for _, v in losses(tmp_path / "run")][-3:] == pytest.approx(
        [v for _, v in losses(clean_run)][-3:], rel=1e-6
    )
    assert leftovers(tmp_path / "run") == []


def test_cache_features_killed_after_a_shard_writes_the_clean_cache(
    tiny_dirs, tiny_data, tmp_path: Path
):
    def args(out: Path) -> list[str]:
        return [
            f"target.name_or_path={tiny_dirs['llama']}",
            "target.device=cpu",
            "target.num_threads=1",
            f"train.datasets=[{tiny_data}]",
            "head.kind=eagle3",
            f"features.output_dir={out}",
            "features.shard_size=5",
            "features.batch_size=5",
            "features.dtype=float32",
        ]

    assert killed(headway("cache-features", *args(tmp_path / "f"), kill_at="features:shard:1"))
    assert len(list((tmp_path / "f" / "shards").glob("*.safetensors"))) == 2
    assert headway("cache-features", *args(tmp_path / "f")).returncode == 0
    assert headway("cache-features", *args(tmp_path / "clean")).returncode == 0
    cut, clean = (
        json.loads((d / "manifest.json").read_text()) for d in (tmp_path / "f", tmp_path / "clean")
    )
    assert cut["shards"] == clean["shards"]  # same keys, same bytes (sha256)
    assert leftovers(tmp_path / "f") == []


@pytest.mark.parametrize("fmt", ["vllm", "native"])
def test_export_killed_before_the_rename_leaves_the_old_export_whole(
    tiny_dirs, clean_run: Path, tmp_path: Path, fmt: str
):
    out = tmp_path / "export"
    args = [
        "--head",
        str(clean_run),
        "--format",
        fmt,
        "--out",
        str(out),
        f"target.name_or_path={tiny_dirs['llama']}",
        "target.device=cpu",
    ]
    assert killed(headway("export", *args, kill_at="export:written"))
    assert not out.exists()  # nothing half-written under the real name
    assert headway("export", *args).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert killed(headway("export", *args, "--dtype", "float32", kill_at="export:written"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = headway("export", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert leftovers(tmp_path) == []


# ---- damaged files: checksums recorded at write time, checked at load time ----


def test_damaged_head_is_named_not_loaded(clean_run: Path, tmp_path: Path):
    head = shutil.copytree(clean_run / "head", tmp_path / "head")
    flip_byte(head / "model.safetensors")
    with pytest.raises(
        HeadwayError, match=r"head .*model.safetensors does not match its recorded sha256"
    ):
        load_head(head)


def test_damaged_checkpoint_is_skipped_by_auto_and_named_when_asked_for(
    clean_run: Path, tmp_path: Path
):
    ckpts = shutil.copytree(clean_run / "checkpoints", tmp_path / "checkpoints")
    assert latest_checkpoint(ckpts).name == "step-00000006"
    flip_byte(ckpts / "step-00000006" / "state.pt")
    assert latest_checkpoint(ckpts).name == "step-00000003"  # the newest whole one
    with pytest.raises(
        HeadwayError,
        match=r"checkpoint .*step-00000006: state.pt does not match its recorded sha256",
    ):
        read_checkpoint(ckpts / "step-00000006", None, False)
    (ckpts / "step-00000003" / "heads.safetensors").write_bytes(b"")
    with pytest.raises(HeadwayError, match=r"heads.safetensors is truncated or damaged \(0 bytes"):
        read_checkpoint(ckpts / "step-00000003", None, False)


def test_damaged_dataset_is_named_not_loaded(tiny_data: Path, tmp_path: Path):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    flip_byte(next(data.glob("data-*.arrow")))
    with pytest.raises(
        HeadwayError,
        match=r"dataset .*data-00000-of-00001.arrow does not match its recorded sha256.*"
        r"delete manifest.json and rerun",
    ):
        load_distilled(data)


def test_a_damaged_chunk_is_generated_again(tiny_dirs, prompts_file: Path, tmp_path: Path):
    args = distill_args(tiny_dirs["llama"], prompts_file, tmp_path / "d")
    assert killed(headway("distill", *args, kill_at="distill:chunk:1"))
    chunk = tmp_path / "d" / "chunks" / "chunk-000000.json"
    chunk.write_text(chunk.read_text()[:50])  # cut short by a failing disk, say
    assert headway("distill", *args).returncode == 0
    assert load_distilled(tmp_path / "d")[0]["id"] == list(range(9))


# ---- bad input: one message naming the thing and the fix ----


def test_invalid_utf8_and_empty_prompt_files(tmp_path: Path):
    (tmp_path / "p.jsonl").write_bytes(b'{"instruction": "ok"}\n{"instruction": "caf\xe9"}\n')
    with pytest.raises(
        HeadwayError, match=r"p.jsonl line 2 is not valid UTF-8 .*re-save the file as UTF-8"
    ):
        load_conversations(PromptConfig(path=str(tmp_path / "p.jsonl")))
    (tmp_path / "p.json").write_bytes(b'[{"instruction": "\xff"}]')
    with pytest.raises(HeadwayError, match=r"p.json is not valid UTF-8"):
        load_conversations(PromptConfig(path=str(tmp_path / "p.json")))
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(HeadwayError, match=r"blank.jsonl holds no records"):
        load_conversations(PromptConfig(path=str(tmp_path / "blank.jsonl")))
    (tmp_path / "s.jsonl").write_text('{"instruction": "\\ud800 lone"}\n')
    with pytest.raises(HeadwayError, match=r"s.jsonl line 1: the text holds an unpaired surrogate"):
        load_conversations(PromptConfig(path=str(tmp_path / "s.jsonl")))


def test_config_type_errors_and_unparsable_overrides_are_named():
    with pytest.raises(HeadwayError, match=r"bad value for config key 'target.trust_remote_code'"):
        load_config(RunConfig, None, ["target.trust_remote_code=maybe"])
    with pytest.raises(
        HeadwayError, match=r"cannot parse override 'target.dtype=\[' .*quote the value"
    ):
        load_config(RunConfig, None, ["target.dtype=["])


def test_prompt_longer_than_the_context_is_refused(tiny_dirs):
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1))
    drafter = EagleDrafter(random_head(t, "eagle3").float(), t.config.num_hidden_layers, 2, 2, 4)
    ids = [5] * t.config.max_position_embeddings
    with pytest.raises(
        HeadwayError, match=r"prompt \(\d+\) \+ max_new_tokens \(8\) exceeds the target's context"
    ):
        speculative_generate(t.model, drafter, ids, 8, [t.tokenizer.eos_token_id])


def test_draft_vocabulary_larger_than_the_target_is_refused(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.train.loop import train

    with pytest.raises(
        HeadwayError,
        match=r"head.eagle3.draft_vocab_size=5000 is larger than the target's vocabulary "
        r"\((\d+) tokens\): set it to at most \1",
    ):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "r",
                "head.kind=eagle3",
                "head.eagle3.draft_vocab_size=5000",
            )
        )


def test_non_finite_loss_stops_naming_step_and_batch_and_keeps_the_last_checkpoint(
    tiny_dirs, tiny_data, tmp_path: Path, monkeypatch
):
    import headway.train.loop as loop
    import headway.train.step as step

    real, calls = step.step_loss, {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += args[0].objective.training  # training micro-batches only, not evaluation
        # step 5's first micro-batch
        return (loss * float("nan") if calls["n"] == 9 else loss), metrics

    monkeypatch.setattr(step, "step_loss", poisoned)
    with pytest.raises(
        HeadwayError,
        match=r"loss became nan at step 5 \(batch: sequences .*#\d+.*\); nothing of this "
        r"step was applied and the last good checkpoint is .*step-00000003",
    ):
        loop.train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "r", *EAGLE3))
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-00000003"]


def test_a_lagged_finite_check_stops_one_step_late_and_keeps_the_last_checkpoint(
    tiny_dirs, tiny_data, tmp_path: Path, monkeypatch
):
    """train.finite_check=lagged (the CUDA default) reads step 5's losses when step 6 is queued: it
    names step 5, says its update was applied, and step 6's checkpoint is never written."""
    import headway.train.loop as loop
    import headway.train.step as step

    real, calls = step.step_loss, {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += args[0].objective.training
        # step 5's first micro-batch
        return (loss * float("nan") if calls["n"] == 9 else loss), metrics

    monkeypatch.setattr(step, "step_loss", poisoned)
    with pytest.raises(
        HeadwayError,
        match=r"loss became nan at step 5 \(batch: sequences .*#\d+.*\); its update was applied "
        r"\(train.finite_check=lagged reads the loss a step late\) and not saved and the last good "
        r"checkpoint is .*step-00000003",
    ):
        loop.train(
            small_run(
                tiny_dirs["llama"], tiny_data, tmp_path / "r", *EAGLE3, "train.finite_check=lagged"
            )
        )
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-00000003"]


def test_a_changed_run_is_not_resumed_into(tiny_dirs, tiny_data, clean_run: Path, tmp_path: Path):
    run = shutil.copytree(clean_run, tmp_path / "run")
    res = headway(
        "train", *train_args(tiny_dirs["llama"], tiny_data, run, "head.eagle3.ttt_steps=3")
    )
    assert (
        res.returncode == 2
        and "holds checkpoints of a run with other settings (head changed)" in res.stderr
    )


def test_disk_full_is_named_and_the_old_file_is_intact(tmp_path: Path, monkeypatch):
    import headway.io as hio

    path = tmp_path / "state.json"
    atomic_write_json(path, {"old": True})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hio.os, "fsync", full)
    with pytest.raises(
        HeadwayError,
        match=r"no space left on the device while writing .*state.json: free some disk",
    ):
        atomic_write_text(path, "x" * 10000)
    assert json.loads(path.read_text()) == {"old": True} and leftovers(tmp_path) == []
    with pytest.raises(HeadwayError, match=r"no space left on the device while writing .*head"):
        save_head(_tiny_head(), tmp_path / "head", {"id": "x"})
    assert not (tmp_path / "head").exists() and leftovers(tmp_path) == []


def test_the_temp_sweep_removes_only_headway_temps(tmp_path: Path):
    mine = tmp_path / ".state.json.bak"
    mine.write_text("the user's own file")
    stale = tmp_path / ".state.json.headway-tmp-abc.tmp"
    stale.write_text("left by a killed writer")
    atomic_write_json(tmp_path / "state.json", {"new": True})
    assert mine.read_text() == "the user's own file" and not stale.exists()


def _tiny_head():
    from headway.heads.medusa import MedusaConfig
    from headway.kinds.registry import build_head

    return build_head("medusa", MedusaConfig(num_heads=1, lm_head="own"), 8, 16)


# ---- untrusted files: data is never executed ----


def test_yaml_tags_that_would_run_code_are_refused(tmp_path: Path):
    marker = tmp_path / "ran"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target:\n  name_or_path: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(HeadwayError, match=r"cannot parse config file"):
        load_config(RunConfig, cfg)
    assert not marker.exists()


def test_model_code_and_pickled_weights_are_not_run(tiny_dirs, tmp_path: Path):
    marker = tmp_path / "ran"
    custom = shutil.copytree(tiny_dirs["llama"], tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    config.update(
        model_type="headway_custom",
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    )
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(
        HeadwayError, match=r"ships its own Python code .*target.trust_remote_code=true"
    ):
        load_target(TargetConfig(name_or_path=str(custom), device="cpu"))
    assert not marker.exists()

    pickled = shutil.copytree(tiny_dirs["llama"], tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(
        HeadwayError, match=r"has no .safetensors weights: Headway does not load pickled weights"
    ):
        load_target(TargetConfig(name_or_path=str(pickled), device="cpu"))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /nonexistent-headway-marker",))


def test_checkpoint_state_with_pickled_code_is_refused(clean_run: Path, tmp_path: Path):
    ckpt = shutil.copytree(clean_run / "checkpoints" / "step-00000003", tmp_path / "step-00000003")
    torch.save({"optimizer": _RunsCode()}, ckpt / "state.pt")
    trainer = json.loads((ckpt / "trainer.json").read_text())
    del trainer["files"]  # rewritten by whoever planted it, checksums and all
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    with pytest.raises(
        HeadwayError, match=r"state.pt holds more than tensors and plain containers"
    ):
        read_checkpoint(ckpt, None, False)


# ---- under load ----


def test_memory_stays_flat_over_a_long_prompt_set(tiny_dirs):
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1))
    drafter = EagleDrafter(random_head(t, "eagle3").float(), t.config.num_hidden_layers, 3, 3, 8)
    prompts = [chat_ids(t, f"Prompt {i}: " + "tell me more " * (i % 7)) for i in range(56)]

    def live_tensor_bytes() -> int:
        gc.collect()
        # plain tensors only: torch.compile (other tests, same process) leaves fake tensors with
        # symbolic sizes
        return sum(
            o.numel() * o.element_size()
            for o in gc.get_objects()
            if type(o) in (torch.Tensor, torch.nn.Parameter)
        )

    marks = {}
    for i, ids in enumerate(prompts):
        speculative_generate(t.model, drafter, ids, 24, [t.tokenizer.eos_token_id])
        if i in (20, 55):  # prompts of the same length
            marks[i] = live_tensor_bytes()
    # nothing kept per prompt: no cache or history growth
    assert marks[55] <= marks[20] * 1.01 + 4096, marks


def test_a_time_limit_stops_at_a_log_step_with_a_checkpoint_and_a_head(
    tiny_dirs, tiny_data, tmp_path: Path
):
    """train.max_seconds: the run stops at the first log step past it, evaluated, checkpointed and
    exported as at max_steps; a rerun without the limit resumes there and finishes."""
    from headway.train.loop import train

    out = tmp_path / "run"
    head = train(
        small_run(tiny_dirs["llama"], tiny_data, out, "train.max_seconds=1e-9", "train.log_every=2")
    )
    assert (head / "config.json").is_file()
    assert [s for s, _ in losses(out)] == [1, 2]
    assert latest_checkpoint(out / "checkpoints").name == "step-00000002"
    train(small_run(tiny_dirs["llama"], tiny_data, out))
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4, 5, 6]


def _edited_copy(head: Path, out: Path, **changes) -> Path:
    copy = shutil.copytree(head, out)
    config = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():  # (only the fields the config has)
        section, _, name = key.rpartition("__")
        table = config[section] if section else config
        if name in table:
            table[name] = value
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_a_head_config_that_disagrees_with_its_weights_is_refused_in_one_line(
    tiny_dirs, tmp_path: Path
):
    """Every kind: an edited size in config.json is named with its field (the weights' shapes read
    from the file's header, the config's built on the meta device); a config sized for another
    target is named against the target's; the untouched head passes."""
    from headway.heads.medusa import MedusaConfig, MedusaHeads
    from headway.kinds.checkpoint import check_head_shapes
    from headway.target.loading import target_sizes
    from tests.kinds.test_dflash import random_head as dflash_head

    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1))
    h, v = t.config.hidden_size, t.config.vocab_size
    medusa = MedusaHeads(MedusaConfig(num_heads=2, lm_head="reduced", draft_vocab_size=64), h, v)
    medusa.attach_target(t.model)
    heads = {
        "eagle3": random_head(t, "eagle3"),
        "eagle": random_head(t, "eagle"),
        "dflash": dflash_head(t),
        "medusa": medusa,
    }
    sizes = target_sizes(TargetConfig(name_or_path=str(tiny_dirs["llama"])))
    assert sizes == {"hidden_size": h, "vocab_size": v}
    for kind, head in heads.items():
        saved = save_head(head, tmp_path / kind, t.fingerprint)
        check_head_shapes(saved, sizes)
        wrong = _edited_copy(saved, tmp_path / f"{kind}-wide", hidden_size=h + 16)
        with pytest.raises(
            HeadwayError, match=rf"disagrees with its weights: .*hidden_size={h + 16}"
        ):
            check_head_shapes(wrong, sizes)
        vocab = _edited_copy(
            saved, tmp_path / f"{kind}-vocab", draft_vocab_size=40, head__draft_vocab_size=40
        )
        # a size the weights decide (a draft vocabulary read from d2t) is refused by name, or
        # harmless: the head then loads as its weights say
        try:
            check_head_shapes(vocab, sizes)
        except HeadwayError as e:
            assert "draft_vocab_size=40" in str(e), e
        else:
            load_head(vocab, t.fingerprint)
    with pytest.raises(
        HeadwayError, match=rf"says vocab_size={v}, but the target has vocab_size={v + 1}"
    ):
        check_head_shapes(tmp_path / "eagle3", {"hidden_size": h, "vocab_size": v + 1})


def test_generate_refuses_an_edited_head_before_the_target_loads(tiny_dirs, tmp_path: Path):
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1))
    saved = save_head(random_head(t, "eagle3"), tmp_path / "head", t.fingerprint)
    wrong = _edited_copy(saved, tmp_path / "wrong", hidden_size=t.config.hidden_size * 2)
    res = headway(
        "generate",
        "--head",
        str(wrong),
        "--prompt",
        "Hi",
        f"target.name_or_path={tiny_dirs['llama']}",
    )
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip() and "Loading" not in line]
    assert (
        len(lines) == 1 and "disagrees with its weights" in lines[0] and "hidden_size=" in lines[0]
    ), res.stderr
    assert "loading target" not in res.stdout + res.stderr
