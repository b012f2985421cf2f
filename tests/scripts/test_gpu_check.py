"""The prepared GPU check (scripts/gpu/gpu_check.sh) runs its every step on the CPU with tiny
budgets (--dry-run, its limits those of scripts/gpu/limits.env), so that the script a GPU run makes
within its budget cannot rot."""

from __future__ import annotations

import json
import os
import subprocess

from tests.helpers import ROOT_DIR

ROOT = ROOT_DIR


def test_gpu_check_dry_run_writes_every_steps_figures(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_WHEELS": str(tmp_path / "none")}
    done = subprocess.run(
        ["bash", "scripts/gpu/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    runs = {r["name"]: r["rc"] for r in records if r["step"] == "run"}
    steps = [
        "setup",
        "env",
        "cudnn",
        "cudnn_deprioritized",
        "capture_tests",
        "backend",
        "exact",
        "decode",
    ]
    assert runs == dict.fromkeys([*steps, "profile", "distill", "bench"], 0), (
        tmp_path / "gpu_check.log"
    ).read_text()[-3000:]
    cudnn = [r for r in records if r["step"] == "cudnn"]
    assert [r["cudnn_sdpa_deprioritized"] for r in cudnn] == ["", "1"]
    assert all(r["plain_ms_per_step"] > 0 and r["verify16_ms_median"] > 0 for r in cudnn)
    # the CUDA backend: a replay time per row count, and its device loop's host reads: one per
    # speculative step, none inside a captured region (what the fake-CUDA run counts, here on CPU
    # tensors)
    backend = [r for r in records if r["step"] == "backend"]
    assert [r["rows"] for r in backend if r["kind"] == "replay"] == [1, 16, 48, 64]
    fake = [r for r in backend if r["kind"] == "fake_cuda"]
    assert len(fake) == 1 and fake[0]["steps"] >= 4, fake
    assert fake[0]["host_reads_per_step"] == 1.0 and fake[0]["reads_inside_steps"] == 0, fake
    assert fake[0]["uploads_inside_steps"] == 0, fake
    loops = [r for r in backend if r["kind"] == "loop"]
    assert loops and all(
        r["host_reads_per_step"] == 1.0 and r["reads_inside_captured"] == 0 for r in loops
    )
    assert all(
        r["captured_regions"] >= 2 * r["steps"] for r in loops
    )  # the expansion and the verification
    exact = [r for r in records if r["step"] == "exact"]
    assert {r["model"] for r in exact} == {
        "tiny-llama",
        "tiny-qwen2",
        "tiny-mistral",
        "tiny-gemma3",
        "default-target",
    }
    assert {(r["dtype"], r["engine"]) for r in exact if r["model"] == "default-target"} == {
        (d, e) for d in ("float32", "bfloat16") for e in ("hf", "static", "cuda")
    }
    # on a CPU, bf16 verification on the static engine is row-exact: every output equals plain
    # greedy decoding
    for r in exact:
        if r["dtype"] == "bfloat16" and r["engine"] == "static":
            assert r["equal"] == r["prompts"], r
    decode = [r for r in records if r["step"] == "decode" and r["method"] != "(all)"]
    assert {r["method"] for r in decode} == {
        "plain",
        "hf_generate",
        "hf_prompt_lookup",
        "hybrid",
        "neural",
        "ngram",
    }
    assert all(
        r["tok_s"] > 0 and r["equal_to_plain"] == r["prompts"]
        for r in decode
        if r["dtype"] == "bfloat16"
    )
    profile = [r for r in records if r["step"] == "profile"]
    assert profile and all(r["kernels_per_forward"] > 0 for r in profile)
    distill = [r for r in records if r["step"] == "distill"]
    assert {(r["dtype"], r["cache"]) for r in distill} == {
        ("bfloat16", "static"),
        ("float32", "dynamic"),
    }
    assert all(r["generated_tokens"] > 0 and r["tok_s"] > 0 for r in distill)
    assert json.loads((tmp_path / "bench.json").read_text())


def test_a_step_past_its_deadline_stops_between_units_and_says_how_far_it_got(tmp_path):
    """A GPU step whose limit is too small for the machine's speed ends itself at a unit boundary,
    with a row saying how many of its planned units it did, instead of being killed mid-unit by its
    shell limit (a unit started before the deadline runs whole)."""
    results = tmp_path / "r.jsonl"
    done = subprocess.run(
        [
            "python",
            "scripts/gpu/gpu_check.py",
            "exact",
            "--dry-run",
            "--deadline",
            "0.001",
            "--results",
            str(results),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    # the first unit (the tiny Llama in float32, on each engine) runs whole; the step stops before
    # the second
    *first, stop = rows
    assert first and all((r["model"], r["dtype"]) == ("tiny-llama", "float32") for r in first), rows
    assert stop == {**stop, "stopped_at_deadline": True, "units_done": 1, "units_planned": 10}
