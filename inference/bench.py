"""`headway bench`: speculative against plain decoding with the same engine, on a prompt file.

Per prompt the two run back to back in alternating order (plain first on even prompts), with the
same thread count and max_new_tokens. Reports tau, acceptance at each draft depth, tokens/s, the
speedup, and (greedy) whether each output matched plain decoding; writes JSON and a Markdown table.
With inference.sampling.temperature > 0 both sample (outputs differ by design; the test suite proves the
distributions equal) and tau is measured at that temperature.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from headway.data_scripts.prompts import PromptConfig, load_conversations
from headway.inference.api import SpeculativeDecoder
from headway.inference.generate import GenerationResult
from headway.io import atomic_write_json, atomic_write_text


def _summary(rows: list[dict], depth: int) -> dict:
    spec_tokens = sum(r["tokens"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    accepted = [a for r in rows for a in r["accepted"]]
    return {
        "prompts": len(rows),
        "tau": (spec_tokens - len(rows)) / max(1, forwards),
        "acceptance_by_depth": [sum(a >= d for a in accepted) / max(1, len(accepted)) for d in range(1, depth + 1)],
        "plain_tok_s": sum(r["plain_tokens"] for r in rows) / sum(r["plain_seconds"] for r in rows),
        "spec_tok_s": spec_tokens / sum(r["spec_seconds"] for r in rows),
        "match_rate": sum(r["match"] for r in rows) / len(rows) if rows[0]["match"] is not None else None,
        # where the speculative time goes, in milliseconds per generated token
        "ms_per_token": {
            "drafting": 1e3 * sum(r["draft_seconds"] for r in rows) / max(1, spec_tokens),
            "verification": 1e3 * sum(r["verify_seconds"] for r in rows) / max(1, spec_tokens),
            "other": 1e3 * sum(r["spec_seconds"] - r["draft_seconds"] - r["verify_seconds"] for r in rows) / max(1, spec_tokens),
        },
    }


def per_category(convs: list, n: int) -> list:
    """The first `n` prompts of each category, in file order (a balanced subset of a large set)."""
    seen: dict[str, int] = {}
    out = []
    for c in convs:
        cat = c.meta.get("category", "all")
        if seen.get(cat, 0) < n:
            out.append(c)
            seen[cat] = seen.get(cat, 0) + 1
    return out


def run_bench(decoder: SpeculativeDecoder, prompts: PromptConfig, max_new_tokens: int, per_cat: int = 0) -> dict:
    convs = load_conversations(prompts)
    if per_cat > 0:
        convs = per_category(convs, per_cat)
    model = decoder.target.model
    warm = decoder.fmt.first_turn("Hello")
    greedy = decoder.cfg.inference.sampling.greedy
    decoder.generate_plain(warm, 4)
    decoder.generate(warm, 4)
    rows = []
    for i, conv in enumerate(tqdm(convs, desc="bench", unit="prompt")):
        ids = decoder.fmt.first_turn(conv.turns[0], conv.system)
        runs: dict[str, GenerationResult] = {}
        for name in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
            runs[name] = decoder.generate_plain(ids, max_new_tokens) if name == "plain" else decoder.generate(ids, max_new_tokens)
        spec, plain = runs["spec"], runs["plain"]
        rows.append({
            "id": conv.id, "category": conv.meta.get("category", "all"), "tokens": len(spec.tokens),
            "target_forwards": spec.target_forwards, "accepted": spec.accepted, "spec_seconds": spec.seconds,
            "plain_tokens": len(plain.tokens), "plain_seconds": plain.seconds, "tau": spec.tau,
            "speedup": spec.tokens_per_second / plain.tokens_per_second, "match": spec.tokens == plain.tokens if greedy else None,
            "draft_seconds": spec.draft_seconds, "verify_seconds": spec.verify_seconds,
        })
    depth = decoder.drafter.max_depth
    categories = sorted({r["category"] for r in rows})
    result = {
        "overall": _summary(rows, depth),
        "by_category": {c: _summary([r for r in rows if r["category"] == c], depth) for c in categories},
        "settings": {"max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(), "drafter": decoder.drafter.settings(),
                     "dtype": str(next(model.parameters()).dtype), "machine": platform.processor() or platform.machine(),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(), "prompts": prompts.path,
                     "date": time.strftime("%Y-%m-%d"),
                     "sampling": dataclasses.asdict(decoder.cfg.inference.sampling)},
        "per_prompt": rows,
    }
    for s in [result["overall"], *result["by_category"].values()]:
        s["speedup"] = s["spec_tok_s"] / s["plain_tok_s"]
    return result


def _match(rate: float | None) -> str:
    return "n/a (sampling)" if rate is None else f"{100 * rate:.0f}%"


def markdown_table(result: dict) -> str:
    lines = ["| category | prompts | tau | plain tok/s | speculative tok/s | speedup | matches plain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in [*result["by_category"].items(), ("**overall**", result["overall"])]:
        lines.append(f"| {name} | {s['prompts']} | {s['tau']:.2f} | {s['plain_tok_s']:.1f} | {s['spec_tok_s']:.1f} | "
                     f"{s['speedup']:.2f}x | {_match(s['match_rate'])} |")
    acc = ", ".join(f"{a:.2f}" for a in result["overall"]["acceptance_by_depth"])
    ms = result["overall"]["ms_per_token"]
    lines.append(f"\nPer generated token: drafting {ms['drafting']:.1f} ms, verification {ms['verification']:.1f} ms, "
                 f"other (prefill, bookkeeping) {ms['other']:.1f} ms.")
    lines.append(f"Acceptance at draft depth 1..{len(result['overall']['acceptance_by_depth'])}: {acc}. "
                 f"Threads {result['settings']['threads']}, {result['settings']['dtype']}, "
                 f"{result['settings']['max_new_tokens']} new tokens.")
    return "\n".join(lines) + "\n"


def write_results(result: dict, out: Path) -> None:
    atomic_write_json(out, result)
    atomic_write_text(out.with_suffix(".md"), markdown_table(result))
