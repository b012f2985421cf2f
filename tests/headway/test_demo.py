"""`headway demo`: the whole pipeline on a tiny target (--train), and the shipped head on the real
default target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from headway.errors import HeadwayError
from tests.helpers.decode_helpers import fast_format


def test_demo_train_runs_the_pipeline_and_decodes_exactly(tiny_dirs, tmp_path: Path):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "headway",
        "demo",
        "--train",
        f"target.name_or_path={tiny_dirs['llama']}",
        "target.num_threads=1",
        f"output_dir={out}",
        "magpie.num_prompts=12",
        "magpie.min_chars=1",
        "magpie.max_prompt_tokens=300",
        "distill.max_new_tokens=16",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.save_every=2",
        "head.eagle3.draft_vocab_size=64",
        "max_new_tokens=12",
        "prompts=[What is 3 plus 4?,Tell me a story.]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for stage in (
        "1/3 self-distillation",
        "2/3 training an EAGLE-3 head",
        "3/3 exported for vLLM",
        "== overall: tau",
    ):
        assert stage in res.stdout, stage
    result = json.loads((out / "results.json").read_text())
    assert result["overall"]["all_equal_plain"] is True and len(result["prompts"]) == 2
    # the speedup is the median of 3 rounds, each prompt's pair decoded back to back in every round
    assert "(median of 3 rounds, range" in res.stdout
    overall = result["overall"]
    assert len(overall["speedups"]) == 3 and overall["speedup"] == sorted(overall["speedups"])[1]
    assert all(len(p["speedups"]) == 3 for p in result["prompts"])
    assert result["head"] == str(out / "eagle3" / "head")
    assert json.loads((out / "eagle3-vllm" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    manifest = json.loads((out / "distill" / "manifest.json").read_text())
    assert manifest["counts"]["samples"] + sum(manifest["counts"]["skipped"].values()) == 12
    # a rerun resumes every stage (nothing is redone) and measures again
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["overall"]["all_equal_plain"] is True


def test_the_speedup_is_the_median_of_rounds_and_a_wide_range_is_flagged():
    from headway.demo import speedup_summary

    tight = speedup_summary([1.50, 1.40, 1.45], wide=0.1)
    assert tight["speedup"] == 1.45 and tight["range"] == [1.40, 1.50] and not tight["wide"]
    assert abs(tight["spread"] - 0.10 / 1.45) < 1e-12
    loose = speedup_summary([1.29, 1.63, 1.50, 1.52], wide=0.1)
    assert loose["speedup"] == (1.50 + 1.52) / 2 and loose["wide"]


def test_demo_without_a_head_names_the_fix(tmp_path: Path):
    res = subprocess.run(
        [sys.executable, "-m", "headway", "demo", f"head_dir={tmp_path / 'none'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "no head at" in res.stderr and "headway demo --train" in res.stderr


@pytest.mark.slow
def test_demo_with_the_shipped_head_on_the_default_target(shared_cache, tmp_path: Path):
    from headway.demo import DemoConfig, reference_head, run_demo
    from headway.target.config import TargetConfig

    head = reference_head()
    assert (head / "model.safetensors").stat().st_size < 25e6  # ~20 MB in bf16
    cfg = DemoConfig(
        target=TargetConfig(cache_dir=str(shared_cache), device="cpu", num_threads=2),
        prompts=["What is 15% of 240? Show your steps."],
        max_new_tokens=32,
        output_dir=str(tmp_path),
    )
    result = run_demo(cfg)
    assert result["overall"]["all_equal_plain"] is True
    # the shipped head's drafts are accepted on the real target
    assert result["overall"]["tau"] > 1.0
    # decoded in bf16 where the CPU has oneDNN's bf16 kernels (oneDNN-packed weights on AMX,
    # float16-packed ones elsewhere), else float32 through the streaming linear
    assert (result["dtype"], result["linear_weights"]) == fast_format()


def test_demo_drafts_one_level_in_float32_and_the_recipe_tree_in_bf16():
    from headway.demo import DemoConfig, decoding_inference
    from headway.target.config import TargetConfig

    cfg = DemoConfig()
    assert decoding_inference(cfg, TargetConfig(dtype="bfloat16")).depth == cfg.inference.depth == 3
    assert decoding_inference(cfg, TargetConfig(dtype="float32")).depth == 1
    assert (
        decoding_inference(DemoConfig(float32_depth=None), TargetConfig(dtype="float32")).depth == 3
    )
    with pytest.raises(HeadwayError, match="float32_depth=0: give a depth >= 1"):
        DemoConfig(float32_depth=0)
