"""The steps of the prepared GPU training run (scripts/gpu/gpu_train.sh) that are not Headway
commands, each appending JSON lines to the run's results file as it goes.

    python scripts/gpu/gpu_train.py diagnose|prompts|pack --results FILE [--dry-run] [...]

- diagnose: the device's matmul peak (bf16 and float32, TFLOP/s), then Hugging Face `generate` on a
  plainly loaded target (AutoModelForCausalLM, nothing of Headway's) in bf16 and float32, and the
  static engine (distill.engine=static) in bf16, in generated tokens/s at one batch size: whether
  bf16 decoding is slow on this machine, and what distillation will run at.
- prompts: the development prompt files in --prompt-dir merged into one JSON-lines file of
  conversations, with every MT-bench question (--held-out) dropped, so the head never trains on its
  evaluation; cut to what the static engine (diagnose's figure) answers in --budget-s, and the
  Magpie prompt count written to --plan.
- tokens: each distilled dataset's answer tokens, engine, batch and throughput (its manifest).
- evals: the training run's evaluations and last logged step (its log.jsonl).
- pack: the exported head (with the run's config and log), as a tar split into parts of at most
  --part-mib MiB, and the distilled datasets compressed (xz) into parts as well, as long as the
  parts fit --max-files files beside the results and log; each part's name, size and sha256
  recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/gpu/, for gpu_check

from gpu_check import BUILT_IN, Results, _device, _sync  # noqa: E402

from headway.data_scripts.config import PromptConfig  # noqa: E402
from headway.data_scripts.engines import HFEngine, SamplingSettings, StaticEngine  # noqa: E402
from headway.prompts import load_conversations  # noqa: E402
from headway.target.chat import ChatFormat  # noqa: E402
from headway.target.config import TargetConfig  # noqa: E402
from headway.target.loading import load_target  # noqa: E402

# (matmul size, HF generate's batch and new tokens, the static engine's new tokens) on the GPU and
# in the dry run; the static engine runs at the distillation batch (--batch)
BUDGET = {"gpu": (8192, 64, 64, 128), "dry": (256, 2, 8, 8)}


def _matmul_tflops(device: str, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    repeats = 20 if device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def _timed_tokens(fn: Any, device: str) -> tuple[int, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return sum(len(g.token_ids) for g in out), time.perf_counter() - start


def step_diagnose(res: Results, dry: bool, static_batch: int) -> None:
    from transformers import AutoModelForCausalLM

    device = _device(dry)
    n, batch, new, static_new = BUDGET["dry" if dry else "gpu"]
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32's own peak, not TF32's
    for dtype in (torch.bfloat16, torch.float32):
        res.write(
            kind="matmul",
            device=device,
            dtype=str(dtype)[6:],
            n=n,
            tflops=round(_matmul_tflops(device, dtype, n), 2),
        )
    base = load_target(TargetConfig(device=device, dtype="float32", num_threads=1 if dry else 0))
    fmt = ChatFormat(base.tokenizer, None, base.generation_config)
    ids = [fmt.first_turn(BUILT_IN[i % len(BUILT_IN)]) for i in range(batch)]
    settings = SamplingSettings(max_new_tokens=new)
    pad = base.tokenizer.pad_token_id
    for dtype in ("bfloat16", "float32"):
        # plainly loaded: transformers' own model, nothing of Headway's (its kernels, formats or
        # patches)
        plain = (
            AutoModelForCausalLM.from_pretrained(str(base.path), dtype=getattr(torch, dtype))
            .to(device)
            .eval()
        )
        engine = HFEngine(plain, pad, fmt.stop_ids, batch_size=batch, cache="dynamic")
        engine.generate(ids[:2], SamplingSettings(max_new_tokens=4), 0)  # warm-up
        tokens, seconds = _timed_tokens(lambda: engine.generate(ids, settings, 0), device)
        res.write(
            kind="hf_generate",
            model="plain",
            device=device,
            dtype=dtype,
            batch=batch,
            max_new_tokens=new,
            generated_tokens=tokens,
            seconds=round(seconds, 2),
            tok_s=round(tokens / seconds, 1),
        )
        plain = engine = None  # (freed before the next dtype loads)
    t = load_target(TargetConfig(device=device, dtype="bfloat16", num_threads=1 if dry else 0))
    ids = [fmt.first_turn(BUILT_IN[i % len(BUILT_IN)]) for i in range(static_batch)]
    static = StaticEngine(
        t.model, fmt.stop_ids, static_batch, max(len(i) for i in ids) + static_new + 1
    )
    static.generate(ids[:2], SamplingSettings(max_new_tokens=4), 0)  # warm-up (and the graphs)
    settings = SamplingSettings(max_new_tokens=static_new)
    tokens, seconds = _timed_tokens(lambda: static.generate(ids, settings, 0), device)
    res.write(
        kind="static_engine",
        device=device,
        dtype="bfloat16",
        batch=static_batch,
        max_new_tokens=static_new,
        generated_tokens=tokens,
        seconds=round(seconds, 2),
        tok_s=round(tokens / seconds, 1),
        steps=static.decoder.steps,
    )


def step_prompts(
    res: Results,
    prompt_dir: Path,
    held_out: Path | None,
    out: Path,
    budget_s: float,
    answer: int,
    plan: Path,
) -> None:
    """Merge every prompt file in prompt_dir (not the held-out one) into `out`, MT-bench questions
    dropped, cut to what the static engine (its diagnose figure) answers in budget_s; the Magpie
    count into `plan`."""
    held = set()
    if held_out is not None and held_out.is_file():
        held = {
            turn.strip()
            for c in load_conversations(PromptConfig(path=str(held_out)))
            for turn in c.turns
        }
    rows, dropped, files = [], 0, []
    for path in sorted(prompt_dir.iterdir()):
        if held_out is not None and path.resolve() == held_out.resolve():
            continue
        if path.suffix not in (".jsonl", ".json", ".parquet"):
            continue
        convs = load_conversations(PromptConfig(path=str(path)))
        files.append({"file": path.name, "prompts": len(convs)})
        for c in convs:
            if any(t.strip() in held for t in c.turns):
                dropped += 1
                continue
            rows.append({"turns": c.turns})
    # the budget: 60% of the distillation time for these prompts, 40% for Magpie's (a question, an
    # answer)
    tok_s = _last(res.path, "diagnose", "static_engine").get("tok_s", 0.0)
    dev = max(4, int(tok_s * budget_s * 0.6 / answer))
    magpie = max(2, int(tok_s * budget_s * 0.4 / (answer + 64)))
    kept = rows[:dev]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    plan.write_text(f"MAGPIE={magpie}\n")
    res.write(
        kind="prompts",
        files=files,
        prompts=len(rows),
        held_out_dropped=dropped,
        kept=len(kept),
        magpie=magpie,
        static_tok_s=tok_s,
        budget_s=budget_s,
        out=str(out),
    )


def _last(results: Path, step: str, kind: str) -> dict:
    """The last record of `step` and `kind` in a results file ({} when none)."""
    found: dict = {}
    if results.is_file():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            if r.get("step") == step and r.get("kind") == kind:
                found = r
    return found


def step_tokens(res: Results, data: list[Path]) -> None:
    """Each distilled dataset's answer tokens and throughput (its manifest), and their total."""
    total = 0
    for d in data:
        path = d / "manifest.json"
        if not path.is_file():
            res.write(kind="dataset", dataset=d.name, finished=False)
            continue
        m = json.loads(path.read_text())
        c = m["counts"]
        total += c["generated_tokens"]
        res.write(
            kind="dataset",
            dataset=d.name,
            finished=True,
            engine=m["engine"],
            batch=m.get("engine_batch_size"),
            samples=c["samples"],
            generated_tokens=c["generated_tokens"],
            unfinished=c["unfinished_samples"],
            tok_s=m["rank0_throughput_tok_s"],
        )
    res.write(kind="datasets", generated_tokens=total)


def step_evals(res: Results, run: Path) -> None:
    """The training run's evaluations and its last logged step (loss, tokens/s, MFU) from its
    log."""
    path = run / "log.jsonl"
    if not path.is_file():
        res.write(kind="train", error=f"no training log at {path}")
        return
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if any("eval" in k for k in r):
            res.write(kind="eval", **{"train_step" if k == "step" else k: v for k, v in r.items()})
    steps = [r for r in rows if "loss" in r]
    if steps:
        res.write(
            kind="train_last",
            **{"train_step" if k == "step" else k: v for k, v in steps[-1].items()},
        )


def _parts(blob: bytes, stem: str, out: Path, part: int) -> list[dict]:
    written = []
    for i in range(0, max(1, len(blob)), part):
        path = out / f"{stem}.part{i // part:02d}"
        chunk = blob[i : i + part]
        path.write_bytes(chunk)
        written.append(
            {"file": path.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
        )
    return written


def _tar(paths: list[Path], compress: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz" if compress else "w") as tar:
        for p in paths:
            tar.add(p, arcname=p.name)
    return buf.getvalue()


def step_pack(
    res: Results,
    head: Path,
    extra: list[Path],
    data: list[Path],
    out: Path,
    part_mib: float,
    max_files: int,
) -> None:
    """The head with `extra` files (a tar, split) and, where the parts fit beside it, the datasets
    (tar.xz, split) into `out`."""
    part = int(part_mib * 2**20)
    free = max_files - 2  # the results file and the log come back too
    if not (head / "config.json").is_file():
        res.write(kind="pack", error=f"no trained head at {head}")
        raise SystemExit(1)
    head_parts = _parts(
        _tar([head] + [e for e in extra if e.is_file()], compress=False), "head.tar", out, part
    )
    free -= len(head_parts)
    res.write(kind="pack", what="head", parts=head_parts, cat="cat head.tar.part* | tar -x")
    blob = _tar([d for d in data if d.is_dir()], compress=True)
    need = -(-len(blob) // part)
    if need > free:
        res.write(
            kind="pack",
            what="data",
            skipped=True,
            bytes=len(blob),
            parts_needed=need,
            parts_free=free,
        )
        return
    res.write(
        kind="pack",
        what="data",
        parts=_parts(blob, "data.tar.xz", out, part),
        cat="cat data.tar.xz.part* | tar -xJ",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["diagnose", "prompts", "tokens", "evals", "pack"])
    ap.add_argument(
        "--results", required=True, help="the JSON-lines file every figure is appended to"
    )
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, with tiny budgets")
    ap.add_argument("--batch", type=int, default=256, help="diagnose: the static engine's batch")
    ap.add_argument("--prompt-dir", type=Path, help="prompts: the development prompt files")
    ap.add_argument(
        "--held-out", type=Path, default=None, help="prompts: the evaluation prompts, left out"
    )
    ap.add_argument(
        "--budget-s", type=float, default=200.0, help="prompts: seconds of distillation"
    )
    ap.add_argument(
        "--answer-tokens", type=int, default=300, help="prompts: expected tokens per answer"
    )
    ap.add_argument(
        "--plan", type=Path, help="prompts: where the Magpie count is written (MAGPIE=N)"
    )
    ap.add_argument(
        "--out", type=Path, help="prompts: the merged file; pack: the folder that comes back"
    )
    ap.add_argument("--run", type=Path, help="evals: the training run's directory")
    ap.add_argument("--head", type=Path, help="pack: the exported head directory")
    ap.add_argument(
        "--extra", type=Path, nargs="*", default=[], help="pack: files packed beside the head"
    )
    ap.add_argument(
        "--data", type=Path, nargs="*", default=[], help="tokens, pack: the distilled datasets"
    )
    ap.add_argument(
        "--part-mib", type=float, default=15.0, help="pack: the largest part, in MiB (GPU_PART_MIB)"
    )
    ap.add_argument(
        "--max-files",
        type=int,
        default=8,
        help="pack: the most files that come back (GPU_MAX_FILES)",
    )
    args = ap.parse_args()
    res = Results(Path(args.results), args.step)
    if args.step == "diagnose":
        step_diagnose(res, args.dry_run, args.batch)
    elif args.step == "prompts":
        step_prompts(
            res,
            args.prompt_dir,
            args.held_out,
            args.out,
            args.budget_s,
            args.answer_tokens,
            args.plan,
        )
    elif args.step == "tokens":
        step_tokens(res, args.data)
    elif args.step == "evals":
        step_evals(res, args.run)
    else:
        step_pack(res, args.head, args.extra, args.data, args.out, args.part_mib, args.max_files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
