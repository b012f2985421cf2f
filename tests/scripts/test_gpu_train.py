"""The prepared GPU training run (scripts/gpu/gpu_train.sh) runs its every step on the CPU with tiny
budgets (--dry-run): a head made from the shipped one and brought back in parts no larger, and no
    more, than
scripts/gpu/limits.env allows, so the script a GPU run makes within its budget cannot rot."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile

from tests.helpers import ROOT_DIR

ROOT = ROOT_DIR


def _limits(env: dict[str, str], *names: str) -> list[str]:
    """The values of `names` in scripts/gpu/limits.env, as the run saw them (with `env`'s
    overrides)."""
    script = "source scripts/gpu/limits.env; " + "; ".join(f'echo "${n}"' for n in names)
    done = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def test_gpu_train_dry_run_makes_a_head_and_brings_it_back_in_parts(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "GPU_WHEELS": str(tmp_path / "none")}
    done = subprocess.run(
        ["bash", "scripts/gpu/gpu_train.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "gpu_train.jsonl").read_text().splitlines()]
    runs = {r["name"]: r["rc"] for r in records if r["step"] == "run"}
    steps = [
        "setup",
        "env",
        "diagnose",
        "prompts",
        "distill_eval",
        "distill_dev",
        "distill_magpie",
        "train",
    ]
    assert runs == dict.fromkeys([*steps, "export", "pack"], 0), (
        out / "gpu_train.log"
    ).read_text()[-3000:]
    diagnose = {(r["kind"], r.get("dtype")) for r in records if r["step"] == "diagnose"}
    assert diagnose == {
        ("matmul", "bfloat16"),
        ("matmul", "float32"),
        ("hf_generate", "bfloat16"),
        ("hf_generate", "float32"),
        ("static_engine", "bfloat16"),
    }
    prompts = next(r for r in records if r["step"] == "prompts")
    assert (
        prompts["held_out_dropped"] == 1 and prompts["kept"] >= 4
    )  # the MT-bench question in dev is dropped
    sets = {r["dataset"]: r for r in records if r.get("kind") == "dataset"}
    assert (
        sets["dev"]["finished"]
        and sets["mtbench"]["finished"]
        and sets["dev"]["engine"] == "static"
    )
    assert any(r.get("kind") == "eval" and "eval/tau/chain" in r for r in records)
    # the head comes back in parts of at most GPU_PART_MIB, in at most GPU_MAX_FILES files
    # (limits.env), which join into the exported head and its run's record
    part_mib, max_files = _limits(env, "GPU_PART_MIB", "GPU_MAX_FILES")
    parts = sorted(out.glob("head.tar.part*"))
    assert parts and all(p.stat().st_size <= float(part_mib) * 2**20 for p in parts)
    assert len(list(out.iterdir())) <= int(max_files)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = set(tar.getnames())
    assert {"export/config.json", "export/model.safetensors", "config.yaml", "log.jsonl"} <= names
    assert list(out.glob("data.tar.xz.part*"))
