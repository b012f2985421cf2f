"""Run vLLM on prompts three ways (no draft, n-gram drafting, a Headway export) and print acceptance
length, per-position acceptance and tokens/s for each. Runs inside the vLLM venv; called by
scripts/check_vllm.sh. Prompts are formatted by Headway's own chat formatting, as `headway bench`
does."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")


def prompt_ids(target: str, prompts: str, limit: int, per_category: int) -> list[list[int]]:
    from transformers import AutoTokenizer, GenerationConfig

    from headway.data_scripts.config import PromptConfig
    from headway.inference.bench.run import per_category as balanced
    from headway.prompts import load_conversations
    from headway.target.chat import ChatFormat

    tok = AutoTokenizer.from_pretrained(target)
    try:
        gen = GenerationConfig.from_pretrained(target)
    except OSError:
        gen = None
    fmt = ChatFormat(tok, None, gen)
    convs = load_conversations(PromptConfig(path=prompts, limit=limit or None))
    if per_category:
        convs = balanced(convs, per_category)
    return [fmt.first_turn(c.turns[0], c.system) for c in convs], fmt.stop_ids


def spec_stats(llm) -> dict:
    counts: dict = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            counts[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    drafts = counts.get("vllm:spec_decode_num_drafts") or 0
    if not drafts:
        return {}
    accepted = counts.get("vllm:spec_decode_num_accepted_tokens") or 0
    per_pos = counts.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return {
        "drafts": drafts,
        "acceptance_length": 1 + accepted / drafts,
        "per_position": [round(a / drafts, 3) for a in per_pos],
    }


def run(mode: str, args, ids: list[list[int]], stops: list[int]) -> dict:
    from vllm import LLM, SamplingParams

    spec = None
    if mode == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    elif mode == "head":
        spec = {"method": args.method, "model": args.draft, "num_speculative_tokens": args.k}
    # speculators: the draft directory alone, as `vllm serve DIR` runs it (target and draft length
    # from its config)
    model = args.speculators if mode == "speculators" else args.target
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=1,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
        enforce_eager=not args.compile,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=stops, detokenize=False
    )
    llm.generate(
        [{"prompt_token_ids": ids[0]}],
        SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False,
    )  # warm-up
    before = spec_stats(llm)
    tokens, seconds, outputs = 0, 0.0, []
    for p in ids:  # one at a time: batch-1 latency, as headway bench measures
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
    if (
        mode == "plain" and args.prefill
    ):  # a prompt of random ids, one new token: the prefill's cost, best of 3
        gen = random.Random(0)
        times = []
        for _ in range(3):
            prompt = [gen.randrange(1000, 20000) for _ in range(args.prefill)]
            start = time.perf_counter()
            llm.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(max_tokens=1, temperature=0.0),
                use_tqdm=False,
            )
            times.append(time.perf_counter() - start)
        prefill = {"prefill_tokens": args.prefill, "prefill_ms": 1e3 * min(times)}
    else:
        prefill = {}
    stats = spec_stats(llm)
    if before and stats:  # leave out the warm-up's drafts
        d = stats["drafts"] - before["drafts"]
        acc = (stats["acceptance_length"] - 1) * stats["drafts"] - (
            before["acceptance_length"] - 1
        ) * before["drafts"]
        stats = {
            "drafts": d,
            "acceptance_length": 1 + acc / d if d else None,
            "per_position": [
                round((a * stats["drafts"] - b * before["drafts"]) / d, 3)
                for a, b in zip(stats["per_position"], before["per_position"])
            ]
            if d
            else [],
        }
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        **prefill,
        **stats,
        "outputs": outputs,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--method", required=True, choices=["eagle3", "eagle", "medusa"])
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--prefill", type=int, default=0, help="also time a prefill of this many tokens (plain run)"
    )
    p.add_argument(
        "--speculators", help="also run this speculators-format export with no speculative config"
    )
    p.add_argument(
        "--mode",
        choices=["plain", "ngram", "head", "speculators"],
        help="one engine run (the script runs each in its own process)",
    )
    args = p.parse_args()
    ids, stops = prompt_ids(args.target, args.prompts, args.limit, args.per_category)
    if (
        args.mode
    ):  # vLLM does not start a second engine cleanly in one process: one process per mode
        with open(f"{args.out}.{args.mode}", "w") as f:
            json.dump(run(args.mode, args, ids, stops), f)
        return
    results = []
    for mode in ("plain", "ngram", "head") + (("speculators",) if args.speculators else ()):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], check=True)
        with open(f"{args.out}.{mode}") as f:
            results.append(json.load(f))
    plain = results[0]["outputs"]
    for r in results:
        r["matches_plain"] = sum(o == q for o, q in zip(r.pop("outputs"), plain)) / len(plain)
        print(
            f"vllm {r['mode']:6s} tok/s {r['tok_s']:7.1f}  acceptance length "
            f"{r.get('acceptance_length') or 1.0:.2f}  per position {r.get('per_position', [])}  matches "
            f"plain {100 * r['matches_plain']:.0f}%"
            + (
                f"  prefill of {r['prefill_tokens']} tokens {r['prefill_ms']:.0f} ms"
                if "prefill_ms" in r
                else ""
            ),
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "prompts": len(ids), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
