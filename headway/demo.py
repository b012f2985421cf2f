"""`headway demo`: the main job on the default target, from a fresh machine, with numbers measured
in the run.

Without `--train` it decodes a handful of prompts of different kinds with the EAGLE-3 head that
ships with Headway (heads/reference/), beside plain decoding of the same target, and prints the
text, tau, tokens/s, the speedup and whether the output equals plain greedy decoding. With `--train`
it first runs the whole pipeline on a small budget: the target writes its own prompts and answers
them (Magpie-style self-distillation), an EAGLE-3 head is trained on that, exported for vLLM, and
then measured the same way. Every budget (prompts, tokens, steps) is a field of DemoConfig.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from headway.data_scripts.config import PromptConfig
from headway.data_scripts.distill import distill, load_distilled
from headway.demo_config import DemoConfig, reference_head
from headway.errors import HeadwayError
from headway.export.exporter import export_head
from headway.inference.api import SpeculativeDecoder
from headway.inference.config import InferenceConfig
from headway.inference.engines.static.layer_loop import build_in_background
from headway.inference.generate import alternate, pooled
from headway.io import atomic_write_json
from headway.run_config import RunConfig
from headway.target.config import TargetConfig
from headway.target.cpu_format import fastest_cpu_format
from headway.target.loading import load_target, resolve_target_dir
from headway.train.loop import train

log = logging.getLogger("headway")


def run_demo(cfg: DemoConfig, train_first: bool = False) -> dict:
    out = Path(cfg.output_dir)
    start = time.time()
    if train_first:
        head_dir = train_pipeline(cfg, out)
    else:
        head_dir = Path(cfg.head_dir) if cfg.head_dir else reference_head()
        if not (head_dir / "model.safetensors").is_file():
            raise HeadwayError(
                f"no head at {head_dir}: pass demo.head_dir=DIR, or run `headway demo --train` to make one"
            )
    result = measure(cfg, head_dir)
    result["wall_seconds"] = time.time() - start
    atomic_write_json(out / "results.json", result)
    print(f"\nwrote {out / 'results.json'}  ({result['wall_seconds'] / 60:.1f} min in all)")
    return result


def _run_config(cfg: DemoConfig, **sections) -> RunConfig:
    return RunConfig(target=cfg.target, inference=cfg.inference, **sections)


def decoding_inference(cfg: DemoConfig, target: TargetConfig) -> InferenceConfig:
    """The demo's inference settings for decoding in `target`'s format: float32_depth in float32."""
    if target.dtype == "float32" and cfg.float32_depth is not None:
        return dataclasses.replace(cfg.inference, depth=cfg.float32_depth)
    return cfg.inference


def decoding_target(cfg: DemoConfig) -> TargetConfig:
    """The target settings the demo decodes with: with target.dtype=auto on a CPU, the fastest exact
    format for it (target/cpu_format.py, as every decoding command), said in one line."""
    target, why = fastest_cpu_format(cfg.target)
    if why:
        print(f"== {why}")
    return target


def train_pipeline(cfg: DemoConfig, out: Path) -> Path:
    """Self-distil, train an EAGLE-3 head and export it for vLLM; returns the head directory.
    Reruns resume."""

    distill_cfg = dataclasses.replace(
        cfg.distill, output_dir=cfg.distill.output_dir or str(out / "distill")
    )
    t0 = time.time()
    print(
        f"== 1/3 self-distillation: the target writes {cfg.magpie.num_prompts} prompts and answers them "
        f"(up to {distill_cfg.max_new_tokens} tokens each)"
    )
    data = distill(cfg.target, PromptConfig(), distill_cfg, cfg.magpie)
    _, manifest = load_distilled(data)
    print(
        f"   {manifest['counts']['samples']} samples, {manifest['counts']['generated_tokens']} answer tokens "
        f"in {(time.time() - t0) / 60:.1f} min -> {data}"
    )
    train_cfg = dataclasses.replace(
        cfg.train, datasets=[str(data)], output_dir=cfg.train.output_dir or str(out / "eagle3")
    )
    t0 = time.time()
    print(
        f"== 2/3 training an EAGLE-3 head: {train_cfg.max_steps} steps of "
        f"{train_cfg.micro_batch_size * train_cfg.grad_accum} sequences"
    )
    head_dir = train(_run_config(cfg, head=cfg.head, train=train_cfg))
    print(f"   trained in {(time.time() - t0) / 60:.1f} min -> {head_dir}")
    target = load_target(cfg.target, with_model=False)
    try:
        exported = export_head(
            head_dir, "vllm", out / "eagle3-vllm", "bfloat16", target.fingerprint
        )
        print(f"== 3/3 exported for vLLM -> {exported}")
    except (
        HeadwayError
    ) as e:  # a target family vLLM's EAGLE-3 layer cannot hold: the native head still decodes here
        print(f"== 3/3 not exported for vLLM: {e}")
    return head_dir


def _describe(settings: dict) -> str:
    """The drafter in a few words: its kind and its tree settings (not every budget knob)."""
    return ", ".join(f"{k} {v}" for k, v in settings.items() if k != "hybrid")


def _by_branch(sources: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))


def speedup_summary(speedups: list[float], wide: float) -> dict:
    """The median of per-round speedups, their range, and whether the range is wide: (max - min)
    over the median above `wide`."""
    ordered = sorted(speedups)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    spread = (ordered[-1] - ordered[0]) / median if median else 0.0
    return {
        "speedup": median,
        "range": [ordered[0], ordered[-1]],
        "spread": spread,
        "wide": spread > wide,
    }


def measure(cfg: DemoConfig, head_dir: Path) -> dict:
    """Plain and speculative decoding of every prompt, `cfg.rounds` times, alternating which goes
    first; prints the first round's answers as it goes, then the median speedup over rounds with its
    range."""

    # a first run compiles the C++ kernels while the target is fetched and dequantised (both once,
    # cached)
    build_in_background(cfg.target)
    resolve_target_dir(cfg.target)
    target = decoding_target(cfg)
    run = _run_config(
        dataclasses.replace(cfg, target=target, inference=decoding_inference(cfg, target))
    )
    decoder = SpeculativeDecoder.load(head_dir, run)
    print(
        f"\n== decoding {len(cfg.prompts)} prompts with {head_dir} beside plain decoding, {cfg.rounds} "
        f"rounds ({_describe(decoder.drafter.settings())}, {decoder.target.num_threads} threads, "
        f"{cfg.max_new_tokens} new tokens)"
    )
    decoder.warm_up()
    greedy = decoder.cfg.inference.sampling.greedy
    runners = {
        "plain": lambda ids: decoder.generate_plain(ids, cfg.max_new_tokens),
        "spec": lambda ids: decoder.generate(ids, cfg.max_new_tokens),
    }
    ids = [decoder.fmt.first_turn(text) for text in cfg.prompts]
    rows: list[dict] = []
    specs, plains, speedups = [], [], []
    bar = tqdm(total=cfg.rounds * len(ids), desc="demo", unit="prompt")
    for r in range(cfg.rounds):
        round_specs, round_plains = [], []
        for i, text in enumerate(cfg.prompts):
            # each prompt's pair runs back to back, the order alternating by prompt and round
            res = alternate(runners, ids[i], i + r)
            spec, plain = res["spec"], res["plain"]
            bar.update(1)
            round_specs.append(spec)
            round_plains.append(plain)
            same = spec.tokens == plain.tokens if greedy else None
            if r == 0:
                rows.append(_first_round_row(cfg, decoder, text, spec, plain, same))
            else:
                rows[i]["equals_plain"] = rows[i]["equals_plain"] and same if greedy else None
            rows[i].setdefault("speedups", []).append(
                spec.tokens_per_second / plain.tokens_per_second
            )
        speedups.append(pooled(round_specs)["tok_s"] / pooled(round_plains)["tok_s"])
        specs += round_specs
        plains += round_plains
    bar.close()
    spec_all, plain_all = pooled(specs), pooled(plains)
    summary = speedup_summary(speedups, cfg.wide_spread)
    overall = {
        "tau": spec_all["tau"],
        "spec_tok_s": spec_all["tok_s"],
        "plain_tok_s": plain_all["tok_s"],
        "speedup": summary["speedup"],
        "speedup_range": summary["range"],
        "speedups": speedups,
        "all_equal_plain": all(r["equals_plain"] for r in rows) if greedy else None,
    }
    lo, hi = summary["range"]
    print(
        f"\n== overall: tau {overall['tau']:.2f} | speculative {spec_all['tok_s']:.1f} tok/s | plain "
        f"{plain_all['tok_s']:.1f} tok/s | speedup {summary['speedup']:.2f}x (median of {cfg.rounds} rounds, "
        f"range {lo:.2f}-{hi:.2f}x) | every output equals plain greedy: {overall['all_equal_plain']}"
    )
    if summary["wide"]:
        print(
            f"== the rounds' speedups spread {summary['spread']:.0%} around their median: something else is "
            "using this machine, or its clock is changing. For a figure to trust, run on a quiet machine, "
            "with fewer threads than cores (target.num_threads=N), or more rounds (rounds=N)"
        )
    return {
        "head": str(head_dir),
        "drafter": decoder.drafter.settings(),
        "threads": decoder.target.num_threads,
        "device": str(decoder.target.device),
        "dtype": run.target.dtype,
        "linear_weights": run.target.linear_weights,
        "overall": overall,
        "prompts": rows,
    }


def _first_round_row(
    cfg: DemoConfig, decoder: Any, text: str, spec: Any, plain: Any, same: Any
) -> dict:
    """A prompt's first round: its answer printed, and its record."""
    answer = decoder.target.tokenizer.decode(spec.tokens, skip_special_tokens=True).strip()
    tqdm.write(
        f"\n-- {text[:100]}\n{answer[: cfg.show_chars]}{' ...' if len(answer) > cfg.show_chars else ''}\n"
        f"   tau {spec.tau:.2f} | speculative {spec.tokens_per_second:.1f} tok/s | "
        f"plain {plain.tokens_per_second:.1f} tok/s | "
        f"speedup {spec.tokens_per_second / plain.tokens_per_second:.2f}x | equals plain greedy: {same}"
        + (f"\n   accepted drafts by branch: {_by_branch(spec.sources)}" if spec.sources else "")
    )
    return {
        "prompt": text,
        "tokens": len(spec.tokens),
        "tau": spec.tau,
        "spec_seconds": spec.seconds,
        "plain_tokens": len(plain.tokens),
        "plain_seconds": plain.seconds,
        "target_forwards": spec.target_forwards,
        "equals_plain": same,
        "accepted_by_branch": spec.sources,
    }
