"""Run llama.cpp's `llama-server` on prompts two or three ways (no draft, its n-gram drafting, a Headway head
exported with `headway export --format gguf`) and write, for each, tokens/s with the prompt included (as
`headway bench` counts them), the acceptance length (tokens per target step) and whether each output equals
llama.cpp's own plain greedy output. Called by scripts/check_llamacpp.sh; prompts are formatted by Headway's
own chat formatting, as `headway bench` does, and sent as token ids.

    python scripts/llamacpp_spec_run.py --server BIN --target TARGET.gguf --tokenizer HF_DIR \
        --prompts P.jsonl [--draft HEAD.gguf] [--k 3] [--max-tokens 128] [--threads 1] \
        [--per-category 1] --out llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from vllm_spec_run import (
    prompt_ids,
)  # (scripts/: the same prompts, formatted the same, as the vLLM check)

from headway.io import atomic_write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, int]:
    """Start llama-server on a free port and wait until it answers /health."""
    port = _free_port()
    cmd = [
        args.server,
        "-m",
        args.target,
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
    ]
    cmd += ["-c", "4096", "-np", "1", "--no-webui", *extra]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=open(f"{args.out}.{len(extra)}.log", "w")
    )
    for _ in range(600):
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(
                f"llama-server exited ({proc.returncode}): see {args.out}.{len(extra)}.log"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            continue
    proc.kill()
    raise SystemExit("llama-server did not come up in 300 s")


def run(mode: str, args: argparse.Namespace, ids: list[list[int]], stops: list[int]) -> dict:
    """One mode over every prompt: greedy, `max_tokens` new tokens, no prompt cache between requests."""
    extra = {
        "plain": [],
        "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(args.k)],
        # a full chain of K every step, as `headway bench`'s chain drafts it (p-min 0: no early stop)
        "head": [
            "-md",
            str(args.draft),
            "--spec-type",
            "draft-eagle3",
            "--spec-draft-n-max",
            str(args.k),
        ]
        + ["--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(args.threads)],
    }[mode]
    proc, port = serve(args, extra)
    outs, tokens, seconds, accepted = [], 0, 0.0, 0
    try:
        _post(
            port, "/completion", {"prompt": ids[0], "n_predict": 4, "temperature": 0.0}
        )  # warm-up
        for p in ids:
            body = {
                "prompt": p,
                "n_predict": args.max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "ignore_eos": False,
            }
            start = time.perf_counter()
            r = _post(port, "/completion", body)
            seconds += time.perf_counter() - start
            toks = list(r.get("tokens") or [])
            while toks and toks[-1] in stops:
                toks.pop()
            outs.append(toks)
            t = r.get("timings", {})
            tokens += int(t.get("predicted_n", len(toks)))
            accepted += int(t.get("draft_n_accepted", 0))
    finally:
        proc.terminate()
        proc.wait(30)
    steps = max(
        tokens - accepted, 1
    )  # each target step emits its accepted drafts and one token of its own
    return {
        "mode": mode,
        "tok_s": tokens / seconds,
        "acceptance_length": tokens / steps,
        "tokens": tokens,
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--modes", default="plain,ngram,head")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ids, stops = prompt_ids(args.tokenizer, args.prompts, 0, args.per_category)
    modes = [m for m in args.modes.split(",") if m != "head" or args.draft]
    results = [run(m, args, ids, stops) for m in modes]
    plain = next((r["outputs"] for r in results if r["mode"] == "plain"), None)
    for r in results:
        if plain is not None:
            r["matches_plain"] = sum(a == b for a, b in zip(r["outputs"], plain)) / len(plain)
        print(
            f"llama.cpp {r['mode']:<6} tok/s {r['tok_s']:8.1f}  "
            f"acceptance length {r['acceptance_length']:.2f}  matches plain {r.get('matches_plain', 1.0):.0%}"
        )
    atomic_write_json(Path(args.out), {"prompts": len(ids), "k": args.k, "results": results})


if __name__ == "__main__":
    main()
