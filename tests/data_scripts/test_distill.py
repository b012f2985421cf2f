"""Self-distillation on tiny models: exact loss masks, multi-turn glue, resume after SIGKILL,
ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from headway.config import load_config
from headway.data_scripts.config import DistillConfig, MagpieConfig
from headway.data_scripts.distill import answer, distill, load_distilled
from headway.data_scripts.engines import Generation, HFEngine, SamplingSettings
from headway.data_scripts.magpie import write_prompts
from headway.errors import HeadwayError
from headway.prompts import Conversation
from headway.run_config import RunConfig
from headway.target.chat import ChatFormat
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from tests.helpers.dataset_checks import greedy_reference, mask_spans

PROMPTS = [
    {"turns": ["What is two plus three?", "And times four?"]},
    {"instruction": "Write a short poem about the sea."},
    {"instruction": "Say hello."},
    {"turns": ["def add(a, b):", "Explain it.", "Now in one word."]},
    {"instruction": "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000." * 3},
]


def write_prompts_file(path: Path, rows=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(cfg: RunConfig) -> Path:
    """`headway distill` with this config: distill reads the target, prompts, distill and magpie
    sections."""
    return distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie)


def run_cfg(model_dir: Path, prompts: Path, out: Path, *extra: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={model_dir}",
            "target.device=cpu",
            "target.num_threads=1",
            "target.dtype=float64",
            f"prompts.path={prompts}",
            f"distill.output_dir={out}",
            "distill.engine=hf",
            "distill.max_new_tokens=12",
            "distill.chunk_size=2",
            "distill.batch_size=3",
            *extra,
        ],
    )


def test_loss_mask_is_exactly_what_the_target_wrote(tiny_dir: Path, tmp_path: Path):
    """Each masked span equals batch-1 greedy decoding from the context before it (float64: no
    ties)."""
    prompts = write_prompts_file(tmp_path / "p.jsonl")
    out = run(run_cfg(tiny_dir, prompts, tmp_path / "ds"))
    ds, manifest = load_distilled(out)
    target = load_target(
        TargetConfig(name_or_path=str(tiny_dir), device="cpu", num_threads=1, dtype="float64")
    )
    fmt = ChatFormat(target.tokenizer, None, target.generation_config)
    assert len(ds) == len(PROMPTS) and manifest["counts"]["samples"] == len(PROMPTS)
    assert manifest["target_fingerprint"] == target.fingerprint
    for row, src in zip(ds, PROMPTS):
        ids, mask = row["input_ids"], row["loss_mask"]
        turns = src.get("turns") or [src["instruction"]]
        assert len(mask_spans(mask)) == row["num_turns"] == len(turns)
        # the prompt is the chat template's
        assert ids[: mask_spans(mask)[0][0]] == fmt.first_turn(turns[0])
        for start, end in mask_spans(mask):
            ref = greedy_reference(
                target.model, ids[:start], 12, fmt.stop_ids, target.tokenizer.pad_token_id
            )
            assert ids[start:end] == ref
            text = target.tokenizer.decode(ids[start:end])
            assert text == target.tokenizer.decode(ref)
        assert sum(mask) == sum(e - s for s, e in mask_spans(mask))
    assert manifest["counts"]["generated_tokens"] == sum(sum(r["loss_mask"]) for r in ds)
    assert (out / "config.yaml").is_file()


class ScriptedEngine:
    """Answers every prompt with fixed tokens: lets the chat glue be checked exactly."""

    name = "scripted"

    def __init__(self, answers: list[list[int]], finished: bool):
        self.answers, self.finished, self.calls = answers, finished, []

    def generate(self, prompts, settings, seed, progress=None):
        self.calls.append([list(p) for p in prompts])
        return [Generation(list(self.answers[len(self.calls) - 1]), self.finished) for _ in prompts]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("finished", [True, False])
def test_multi_turn_glue_matches_the_template(tiny_dirs, arch: str, finished: bool):
    """A follow-up turn's prompt is the template's rendering of the whole conversation, token for
    token."""
    tok = load_target(
        TargetConfig(name_or_path=str(tiny_dirs[arch]), device="cpu"), with_model=False
    ).tokenizer
    fmt = ChatFormat(tok)
    eos = fmt.stop_ids[0]
    words = [
        tok("Two plus three is five.", add_special_tokens=False)["input_ids"],
        tok(" Twenty.", add_special_tokens=False)["input_ids"],
    ]
    answers = [w + [eos] if finished else w for w in words]
    engine = ScriptedEngine(answers, finished)
    conv = Conversation(id=0, turns=["What is two plus three?", "And times four?"])
    rows, skipped = answer([conv], fmt, engine, DistillConfig(max_new_tokens=8), 512, 0)
    (row,) = rows
    assert not skipped and row["num_turns"] == 2 and row["finished"] == finished
    full = tok.apply_chat_template(
        [
            {"role": "user", "content": conv.turns[0]},
            {"role": "assistant", "content": "Two plus three is five."},
            {"role": "user", "content": conv.turns[1]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    second_prompt = engine.calls[1][0]
    if finished:  # the closing token came from the target, and is not written twice
        assert tok.decode(second_prompt) == full
    else:  # the turn was cut: the template closes it, and those tokens are not the target's
        assert tok.decode(second_prompt) == full
        assert row["loss_mask"][len(engine.calls[0][0]) + len(words[0])] == 0
    assert [row["input_ids"][s:e] for s, e in mask_spans(row["loss_mask"])] == answers


def test_too_long_prompts_skip_or_fail(tiny_dirs, tmp_path: Path):
    prompts = write_prompts_file(
        tmp_path / "p.jsonl", [{"instruction": "word " * 300}, {"instruction": "Hi."}]
    )
    out = run(run_cfg(tiny_dirs["llama"], prompts, tmp_path / "skip"))
    ds, manifest = load_distilled(out)
    assert ds["id"] == [1] and manifest["counts"]["skipped"] == {"too_long": 1}
    with pytest.raises(
        HeadwayError,
        match=r"prompt 0 has \d+ tokens; with max_new_tokens=12 it exceeds max_length=512",
    ):
        run(run_cfg(tiny_dirs["llama"], prompts, tmp_path / "fail", "distill.on_too_long=error"))
    with pytest.raises(HeadwayError, match=r"no samples: all 1 prompts were skipped \(too_long\)"):
        run(run_cfg(tiny_dirs["llama"], prompts, tmp_path / "none", "prompts.limit=1"))


def test_a_slice_of_the_prompt_file_keeps_its_record_ids(tiny_dirs, tmp_path: Path):
    """prompts.offset/limit pick records [offset, offset + limit): the dataset's ids are those
    records' indices and each answer is the one a whole-file run gives that record (chunks of 2 over
    3 prompts)."""
    prompts = write_prompts_file(tmp_path / "p.jsonl")
    whole, _ = load_distilled(run(run_cfg(tiny_dirs["llama"], prompts, tmp_path / "all")))
    part, manifest = load_distilled(
        run(
            run_cfg(
                tiny_dirs["llama"],
                prompts,
                tmp_path / "part",
                "prompts.offset=1",
                "prompts.limit=3",
            )
        )
    )
    assert part["id"] == [1, 2, 3] and manifest["counts"]["prompts"] == 3
    by_id = dict(zip(whole["id"], whole["input_ids"]))
    assert [by_id[i] for i in part["id"]] == part["input_ids"]
    assert manifest["rank0_throughput_tok_s"] > 0
    # killed after the last chunk, before the merge: the rerun merges the same dataset, generating
    # nothing
    (tmp_path / "part" / "manifest.json").unlink()
    again, manifest = load_distilled(
        run(
            run_cfg(
                tiny_dirs["llama"],
                prompts,
                tmp_path / "part",
                "prompts.offset=1",
                "prompts.limit=3",
            )
        )
    )
    assert again["input_ids"] == part["input_ids"] and manifest["rank0_throughput_tok_s"] is None


def test_rerun_with_other_settings_is_refused(tiny_dirs, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "p.jsonl", PROMPTS[:2])
    out = tmp_path / "ds"
    (out / "chunks").mkdir(parents=True)
    run(run_cfg(tiny_dirs["llama"], prompts, out, "prompts.limit=1"))
    (out / "manifest.json").unlink()
    with pytest.raises(HeadwayError, match="other settings .*generation"):
        run(
            run_cfg(tiny_dirs["llama"], prompts, out, "prompts.limit=1", "distill.max_new_tokens=5")
        )
    with pytest.raises(HeadwayError, match="incomplete"):
        load_distilled(out)
    with pytest.raises(HeadwayError, match="not a headway dataset"):
        load_distilled(tmp_path)


def test_magpie_prompts_come_from_the_target(tiny_dirs, tmp_path: Path):
    target = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    )
    fmt = ChatFormat(target.tokenizer, None, target.generation_config)
    eos = fmt.stop_ids[0]
    q = target.tokenizer("What is the capital of France?", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine([q + [eos]], True)
    texts = write_prompts(engine, fmt, MagpieConfig(num_prompts=3), 3, seed=0)
    assert engine.calls[0] == [fmt.user_prefix()] * 3
    assert texts == ["What is the capital of France?", None, None]  # duplicates are dropped
    assert target.tokenizer.decode(fmt.user_prefix()) == "<|im_start|>user\n"
    # End to end with the real (random) model: every id is a sample or a counted rejection.
    cfg = run_cfg(
        tiny_dirs["llama"],
        tmp_path / "unused",
        tmp_path / "mag",
        "magpie.num_prompts=12",
        "magpie.min_chars=1",
        "magpie.max_prompt_tokens=300",
    )
    cfg.prompts.path = None
    out = run(cfg)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt_source"] == "magpie"
    assert manifest["counts"]["samples"] > 0
    assert manifest["counts"]["samples"] + sum(manifest["counts"]["skipped"].values()) == 12


def test_hf_engine_batches_like_batch_one(tiny_dirs):
    """Left-padded batches give the same greedy tokens as one prompt at a time (float64)."""
    target = load_target(
        TargetConfig(
            name_or_path=str(tiny_dirs["qwen2"]), device="cpu", num_threads=1, dtype="float64"
        )
    )
    fmt = ChatFormat(target.tokenizer, None, target.generation_config)
    prompts = [
        fmt.first_turn(p)
        for p in ["Hi.", "Write a short poem about the sea and the sky.", "Numbers: 1 2 3"]
    ]
    settings = SamplingSettings(max_new_tokens=10)
    batched = HFEngine(
        target.model, target.tokenizer.pad_token_id, fmt.stop_ids, batch_size=3
    ).generate(prompts, settings, 0)
    single = HFEngine(
        target.model, target.tokenizer.pad_token_id, fmt.stop_ids, batch_size=1
    ).generate(prompts, settings, 0)
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    # a static KV cache (distill.hf_cache=static, the default on GPUs) writes the same answers
    static = HFEngine(
        target.model, target.tokenizer.pad_token_id, fmt.stop_ids, batch_size=3, cache="static"
    )
    assert static.cache == "static" and [
        g.token_ids for g in static.generate(prompts, settings, 0)
    ] == [g.token_ids for g in single]
    assert (
        HFEngine(target.model, target.tokenizer.pad_token_id, fmt.stop_ids).cache == "dynamic"
    )  # auto, on a CPU
    sampled = HFEngine(target.model, target.tokenizer.pad_token_id, fmt.stop_ids, batch_size=3)
    s = SamplingSettings(max_new_tokens=10, temperature=1.0)
    assert [g.token_ids for g in sampled.generate(prompts, s, 7)] == [
        g.token_ids for g in sampled.generate(prompts, s, 7)
    ]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "headway", "distill", *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cli_overrides(model_dir: Path, prompts: Path, out: Path) -> list[str]:
    return [
        f"target.name_or_path={model_dir}",
        "target.device=cpu",
        "target.num_threads=1",
        f"prompts.path={prompts}",
        f"distill.output_dir={out}",
        "distill.engine=hf",
        "distill.max_new_tokens=24",
        "distill.chunk_size=4",
        "distill.batch_size=4",
    ]


def test_sigkill_midway_then_rerun_finishes_every_prompt_once(tiny_dirs, tmp_path: Path):
    rows = [{"instruction": f"Question number {i}: what is {i} plus {i}?"} for i in range(120)]
    prompts = write_prompts_file(tmp_path / "p.jsonl", rows)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli(*_cli_overrides(tiny_dirs["llama"], prompts, out)),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "chunks").glob("chunk-*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = {p.name: p.stat().st_mtime_ns for p in (out / "chunks").glob("chunk-*.json")}
    assert 3 <= len(written) < 30, "the run must be killed midway"
    assert not (out / "manifest.json").exists()
    subprocess.run(
        _cli(*_cli_overrides(tiny_dirs["llama"], prompts, out)),
        env=_env(),
        check=True,
        capture_output=True,
    )
    ds, manifest = load_distilled(out)
    assert ds["id"] == list(range(120))
    for name, mtime in written.items():  # finished chunks were kept, not redone
        assert (out / "chunks" / name).stat().st_mtime_ns == mtime
    clean = tmp_path / "clean"
    subprocess.run(
        _cli(*_cli_overrides(tiny_dirs["llama"], prompts, clean)),
        env=_env(),
        check=True,
        capture_output=True,
    )
    ref, _ = load_distilled(clean)
    assert ds["input_ids"] == ref["input_ids"] and ds["loss_mask"] == ref["loss_mask"]


def test_two_ranks_under_torchrun_cover_every_prompt_once(tiny_dirs, tmp_path: Path):
    rows = [{"instruction": f"Tell me about item {i}."} for i in range(18)]
    prompts = write_prompts_file(tmp_path / "p.jsonl", rows)
    out = tmp_path / "ranks"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "headway",
        "distill",
        *_cli_overrides(tiny_dirs["mistral"], prompts, out),
    ]
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ds, manifest = load_distilled(out)
    assert ds["id"] == list(range(18))
    single = tmp_path / "single"
    subprocess.run(
        _cli(*_cli_overrides(tiny_dirs["mistral"], prompts, single)),
        env=_env(),
        check=True,
        capture_output=True,
    )
    ref, _ = load_distilled(single)
    assert ds["input_ids"] == ref["input_ids"] and ds["loss_mask"] == ref["loss_mask"]


def test_cli_errors_are_one_line(tmp_path: Path):
    res = subprocess.run(
        _cli(
            f"prompts.path={tmp_path / 'none.jsonl'}",
            "distill.engine=hf",
            "target.name_or_path=/no/model",
        ),
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "headway: error: target path does not exist: /no/model ("
    )
    assert "Traceback" not in res.stderr
    res = subprocess.run(
        _cli("distill.max_new_token=3"), env=_env(), capture_output=True, text=True
    )
    assert res.returncode == 2 and "did you mean 'distill.max_new_tokens'" in res.stderr


def test_broken_vllm_install_is_one_clear_error(monkeypatch):
    import importlib.machinery
    import types

    from headway.data_scripts.engines import VLLMEngine

    # imports, but has no LLM: what a half-broken install looks like
    broken = types.ModuleType("vllm")
    broken.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", broken)
    with pytest.raises(
        HeadwayError,
        match="vLLM is installed but cannot be imported .*pip uninstall -y torchvision",
    ):
        VLLMEngine("/nowhere", [2], "float32", 128, 8, 0, 1)
