"""`headway bench`: Headway's speculative decoding beside plain decoding and Hugging Face's own
decoders.

Per prompt (and per turn of multi-turn prompts) every method runs back to back with the same thread
count, prompt ids, stop tokens and max_new_tokens, in an order that rotates from prompt to prompt,
so a slow spell of the machine hits every method alike. Methods: Headway's plain decoding (the
reference), Hugging Face `generate` (greedy), its prompt-lookup decoding, and Headway speculative
decoding. Reported per category and overall: tau, acceptance at each draft depth, tokens/s of every
method, the speculative speedup over each, and (greedy) whether each output equals plain decoding.
Later turns continue from the plain answer to the earlier turns, the same history for every method.
With inference.sampling.temperature > 0 every method samples (outputs differ by design; the test
suite proves the distributions equal) and tau is measured at that temperature.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from headway.data_scripts.config import PromptConfig
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench.baselines import hf_generate
from headway.inference.bench.llamacpp import LLAMACPP, LLAMACPP_HEAD, llamacpp_runners
from headway.inference.bench.plot import plot_results
from headway.inference.config import LABELS, PLAIN, SPEC, BenchConfig
from headway.inference.generate import GenerationResult, alternate
from headway.io import atomic_write_json, atomic_write_text
from headway.prompts import load_conversations


def _rate(hits: list[bool]) -> float:
    return sum(hits) / max(1, len(hits))


def _tau(rows: list[dict], method: str) -> float:
    """Tokens per target forward after the prompt's (each answer's first token comes with the
    prompt)."""
    tokens = sum(r[method]["tokens"] for r in rows)
    return (tokens - len(rows)) / max(1, sum(r[method]["target_forwards"] for r in rows))


def _summary(rows: list[dict], methods: list[str], depth: int, greedy: bool) -> dict:
    spec = [r[SPEC] for r in rows]
    spec_tokens = sum(s["tokens"] for s in spec)
    accepted = [a for s in spec for a in s["accepted"]]
    by_source = {
        k: sum(s.get("sources", {}).get(k, 0) for s in spec) for k in ("neural", "ngram", "both")
    }
    tok_s = {
        m: sum(r[m]["tokens"] for r in rows) / max(1e-9, sum(r[m]["seconds"] for r in rows))
        for m in methods
    }
    return {
        "prompts": len(rows),
        "tau": _tau(rows, SPEC),
        "acceptance_by_depth": [
            sum(a >= d for a in accepted) / max(1, len(accepted)) for d in range(1, depth + 1)
        ],
        "tok_s": tok_s,
        # tau of every method that verifies drafts
        "tau_by_method": {
            m: _tau(rows, m)
            for m in methods
            if m != PLAIN and all(r[m].get("target_forwards") for r in rows)
        },
        # speculative tokens/s over each other method's
        "speedup_over": {m: tok_s[SPEC] / tok_s[m] for m in methods if m != SPEC},
        # share of outputs equal to the method's own plain greedy decoding (Headway's, but llama.cpp's
        # for llama.cpp with the head; None when sampling)
        "matches_plain": {
            m: _rate([r[m]["match"] for r in rows]) if greedy else None
            for m in methods
            if m != PLAIN
        },
        # accepted draft tokens by the branch kind that proposed them (hybrid and n-gram drafters),
        # as shares
        "accepted_from": {k: v / max(1, sum(by_source.values())) for k, v in by_source.items()}
        if any(by_source.values())
        else None,
        # where the speculative time goes, in milliseconds per generated token
        "ms_per_token": {
            "drafting": 1e3 * sum(s["draft_seconds"] for s in spec) / max(1, spec_tokens),
            "verification": 1e3 * sum(s["verify_seconds"] for s in spec) / max(1, spec_tokens),
            "other": 1e3
            * sum(s["seconds"] - s["draft_seconds"] - s["verify_seconds"] for s in spec)
            / max(1, spec_tokens),
        },
        # the headline pair, kept under the names earlier results files used
        "plain_tok_s": tok_s[PLAIN],
        "spec_tok_s": tok_s[SPEC],
        "speedup": tok_s[SPEC] / tok_s[PLAIN],
        "match_rate": _rate([r[SPEC]["match"] for r in rows]) if greedy else None,
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


def _runners(
    decoder: SpeculativeDecoder, bc: BenchConfig, max_new_tokens: int
) -> dict[str, Callable[[list[int]], GenerationResult]]:
    model, stops, sampling = (
        decoder.target.model,
        decoder.fmt.stop_ids,
        decoder.cfg.inference.sampling,
    )
    runners: dict[str, Callable[[list[int]], GenerationResult]] = {
        PLAIN: lambda ids: decoder.generate_plain(ids, max_new_tokens),
        SPEC: lambda ids: decoder.generate(ids, max_new_tokens),
    }
    for kind in bc.drafters:
        if kind != decoder.cfg.inference.drafter:
            other = decoder.with_drafter(kind)
            runners[f"headway_{kind}"] = lambda ids, other=other: other.generate(
                ids, max_new_tokens
            )
    if "hf_generate" in bc.baselines:
        runners["hf_generate"] = lambda ids: hf_generate(
            model, ids, max_new_tokens, stops, sampling
        )
    if "hf_prompt_lookup" in bc.baselines:
        runners["hf_prompt_lookup"] = lambda ids: hf_generate(
            model,
            ids,
            max_new_tokens,
            stops,
            sampling,
            bc.prompt_lookup_tokens,
            bc.prompt_lookup_max_ngram,
        )
    return runners


def _record(res: GenerationResult, plain: GenerationResult | None, greedy: bool) -> dict:
    rec = {
        "tokens": len(res.tokens),
        "seconds": res.seconds,
        "match": (res.tokens == plain.tokens) if greedy and plain is not None else None,
    }
    if res.target_forwards:
        rec.update(
            target_forwards=res.target_forwards,
            accepted=res.accepted,
            tau=res.tau,
            draft_seconds=res.draft_seconds,
            verify_seconds=res.verify_seconds,
            sources=res.sources,
        )
    return rec


def run_bench(
    decoder: SpeculativeDecoder, prompts: PromptConfig, max_new_tokens: int, bc: BenchConfig
) -> dict:
    convs = load_conversations(prompts)
    if bc.per_category > 0:
        convs = per_category(convs, bc.per_category)
    greedy = decoder.cfg.inference.sampling.greedy
    with ExitStack() as stack:  # llama.cpp's servers, while the prompts run
        runners = _runners(decoder, bc, max_new_tokens)
        runners.update(llamacpp_runners(decoder, bc, max_new_tokens, stack))
        rows = _run_prompts(decoder, convs, runners, bc, max_new_tokens, greedy)
    return _result(decoder, prompts, max_new_tokens, bc, _methods(runners), rows, greedy)


def _methods(runners: dict) -> list[str]:
    """Plain first, the speculative method last, the peers between (the tables' column order)."""
    return [PLAIN, *[m for m in runners if m not in (PLAIN, SPEC)], SPEC]


# the output each method's match is measured against: its own plain greedy decoding
REFERENCE = {LLAMACPP_HEAD: LLAMACPP}


def _run_prompts(
    decoder: SpeculativeDecoder,
    convs: list,
    runners: dict,
    bc: BenchConfig,
    max_new_tokens: int,
    greedy: bool,
) -> list[dict]:
    """Every prompt (and later turn) by every method, the methods' order alternating per prompt."""
    methods = _methods(runners)
    # every method once before anything is timed: Headway's through throwaway copies of their
    # drafters, so the greeting does not steer a hybrid's acceptance estimates; Hugging Face's (no
    # learnt state) as they are
    kinds = [m.removeprefix("headway_") for m in runners if m.startswith("headway_")]
    decoder.warm_up(max_new_tokens, [decoder.cfg.inference.drafter, *kinds])
    warm = decoder.fmt.first_turn("Hello")
    for name, run in runners.items():
        if name.startswith(("hf_", "llamacpp")):
            run(warm)
    work = [
        (c, t)
        for c in convs
        for t in range(len(c.turns) if bc.turns == 0 else min(bc.turns, len(c.turns)))
    ]
    rows: list[dict] = []
    # conversation id -> its ids so far (prompts + plain answers)
    history: dict[int, list[int]] = {}
    for i, (conv, turn) in enumerate(tqdm(work, desc="bench", unit="turn")):
        if turn == 0:
            ids = decoder.fmt.first_turn(conv.turns[0], conv.system)
        else:
            ids = history[conv.id] + decoder.fmt.next_turn(
                conv.turns[turn], history[conv.id][-1], conv.system
            )
        results = alternate({m: runners[m] for m in methods}, ids, i)
        plain = results[PLAIN]
        history[conv.id] = ids + plain.tokens
        row = {
            "id": conv.id,
            "turn": turn + 1,
            "category": conv.meta.get("category", "all"),
            "prompt_tokens": len(ids),
        }
        for m in methods:
            ref = None if m == PLAIN else results[REFERENCE.get(m, PLAIN)]
            row[m] = _record(results[m], ref, greedy)
        rows.append(row)
    return rows


def _result(
    decoder: SpeculativeDecoder,
    prompts: PromptConfig,
    max_new_tokens: int,
    bc: BenchConfig,
    methods: list[str],
    rows: list[dict],
    greedy: bool,
) -> dict:
    depth = decoder.drafter.max_depth
    categories = sorted({r["category"] for r in rows})
    model = decoder.target.model
    return {
        "overall": _summary(rows, methods, depth, greedy),
        "by_category": {
            c: _summary([r for r in rows if r["category"] == c], methods, depth, greedy)
            for c in categories
        },
        "by_prompt_length": {
            label: _summary(bucket, methods, depth, greedy)
            for label, bucket in length_buckets(rows, bc.length_buckets).items()
        },
        "methods": methods,
        "settings": {
            "max_new_tokens": max_new_tokens,
            "threads": torch.get_num_threads(),
            "drafter": decoder.drafter.settings(),
            "dtype": str(next(model.parameters()).dtype),
            "device": str(next(model.parameters()).device),
            "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "prompts": prompts.path,
            "date": time.strftime("%Y-%m-%d"),
            "bench": dataclasses.asdict(bc),
            "sampling": dataclasses.asdict(decoder.cfg.inference.sampling),
        },
        "per_prompt": rows,
    }


def length_buckets(rows: list[dict], edges: list[int]) -> dict[str, list[dict]]:
    """The rows by prompt length, the non-empty buckets only, labelled by their token range
    ("1000-1999", "3000+"); `edges` are the buckets' ascending lower edges."""
    out: dict[str, list[dict]] = {}
    for lo, hi in zip(edges, [*edges[1:], None]):
        bucket = [
            r for r in rows if r["prompt_tokens"] >= lo and (hi is None or r["prompt_tokens"] < hi)
        ]
        if bucket:
            out[f"{lo}+" if hi is None else f"{lo}-{hi - 1}"] = bucket
    return out


def _match(rate: float | None) -> str:
    return "n/a (sampling)" if rate is None else f"{100 * rate:.0f}%"


def markdown_table(result: dict) -> str:
    methods = result.get("methods", [PLAIN, SPEC])
    others = [m for m in methods if m != SPEC]
    head = [
        "category",
        "prompts",
        "tau",
        *[f"{LABELS[m]} tok/s" for m in methods],
        *[f"speedup vs {LABELS[m]}" for m in others],
        "matches plain",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, s in [*result["by_category"].items(), ("**overall**", result["overall"])]:
        cells = [
            name,
            str(s["prompts"]),
            f"{s['tau']:.2f}",
            *[f"{s['tok_s'][m]:.1f}" for m in methods],
            *[f"{s['speedup_over'][m]:.2f}x" for m in others],
            _match(s["match_rate"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    o = result["overall"]
    acc = ", ".join(f"{a:.2f}" for a in o["acceptance_by_depth"][:8])
    ms = o["ms_per_token"]
    st = result["settings"]
    lines.append(
        f"\nPer generated token: drafting {ms['drafting']:.1f} ms, verification {ms['verification']:.1f} ms, "
        f"other (prefill, bookkeeping) {ms['other']:.1f} ms."
    )
    if len(result.get("by_prompt_length", {})) > 1:
        lines.append(
            "tau by prompt length (tokens): "
            + ", ".join(
                f"{k} {s['tau']:.2f} ({s['prompts']} prompts)"
                for k, s in result["by_prompt_length"].items()
            )
            + "."
        )
    if len(o.get("tau_by_method", {})) > 1:
        lines.append(
            "tau by method: "
            + ", ".join(f"{LABELS[m]} {t:.2f}" for m, t in o["tau_by_method"].items())
            + "."
        )
    lines.append(
        f"Acceptance at draft depth 1..{min(8, len(o['acceptance_by_depth']))}: {acc}. "
        f"Threads {st['threads']}, {st['dtype']}, {st['max_new_tokens']} new tokens."
    )
    if o.get("accepted_from"):
        lines.append(
            "Accepted draft tokens by branch: "
            + "; ".join(
                f"{name} " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["accepted_from"].items())
                for name, s in [*result["by_category"].items(), ("overall", o)]
                if s.get("accepted_from")
            )
            + "."
        )
    peers = [m for m in others if m != PLAIN]
    if peers and o["matches_plain"][peers[0]] is not None:
        lines.append(
            "Outputs equal to their own plain greedy (Headway's; llama.cpp's for llama.cpp + head): "
            + ", ".join(f"{LABELS[m]} {_match(o['matches_plain'][m])}" for m in [*peers, SPEC])
            + "."
        )
    return "\n".join(lines) + "\n"


def write_results(result: dict, out: Path, plot: bool = True) -> list[Path]:
    """The JSON, a Markdown table beside it, and (plot) a PNG; returns the paths written."""
    atomic_write_json(out, result)
    atomic_write_text(out.with_suffix(".md"), markdown_table(result))
    written = [out, out.with_suffix(".md")]
    if plot:
        written.append(plot_results(result, out.with_suffix(".png")))
    return written
