"""Build the long-prompt evaluation set (inference/bench_prompts_long_eval.jsonl) from Headway's own documentation.

Long prompts are where drafts drift. The set has three kinds, each prompt 1,000-3,000 tokens of the default target's
tokenizer (first turn): summarisation of a stretch of one document, RAG-style questions over several numbered
documents, and multi-turn chat that starts from a document and asks follow-ups. The documents are Headway's own
(docs/*.md, README.md, CHANGELOG.md), so the set can ship with Headway; the choice is seeded, and the file was written
once and committed (rerunning on later docs gives another set).

    python scripts/make_long_prompts.py [--out inference/bench_prompts_long_eval.jsonl] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from headway.target.config import TargetConfig
from headway.target.loading import load_target

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    "README.md",
    "CHANGELOG.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]
MIN_TOKENS, MAX_TOKENS = 1000, 3000
PER_KIND = {"long_summarization": 16, "long_rag": 16, "long_multiturn": 12}  # the first that fit, per kind
SUMMARISE = [
    "Summarize the following documentation in one paragraph for a new engineer.",
    "Read the following text and list its five most important points, one sentence each.",
    "Write a short summary of the following section, then say who would need to read it.",
]
FOLLOW_UPS = [
    "Which of these points would a user of a GPU care about most, and why?",
    "Explain the least obvious part of that again, with a small example.",
    "What would you check first if this stopped working after an upgrade?",
    "Write three questions a reviewer might ask about this, with short answers.",
]


def sections() -> list[tuple[str, str, str]]:
    """(file, heading, text) for every section of the sources, long sections cut at paragraph boundaries."""
    out = []
    for name in SOURCES:
        text = (ROOT / name).read_text()
        parts = re.split(r"\n(?=#{2,3} )", text)
        for part in parts:
            heading = part.splitlines()[0].lstrip("# ").strip() if part.strip() else ""
            paragraphs, chunk = part.split("\n\n"), ""
            for para in paragraphs:
                if len(chunk) + len(para) > 3500 and chunk:
                    out.append((name, heading, chunk.strip()))
                    chunk = ""
                chunk += para + "\n\n"
            if len(chunk.strip()) > 200:
                out.append((name, heading, chunk.strip()))
    return out


def packed(chunks: list[tuple[str, str, str]], start: int, chars: int) -> list[tuple[str, str, str]]:
    """Consecutive chunks from `start` until about `chars` characters."""
    picked, total = [], 0
    for chunk in chunks[start:]:
        if total > chars:
            break
        picked.append(chunk)
        total += len(chunk[2])
    return picked


def build(seed: int) -> list[dict]:
    rng = random.Random(seed)
    chunks = sections()
    records: list[dict] = []
    for i in range(30):  # summarisation: a stretch of one file
        start = rng.randrange(len(chunks) - 6)
        body = "\n\n".join(c[2] for c in packed(chunks, start, rng.randint(3000, 7000)))
        records.append(
            {"category": "long_summarization", "prompt": f"{SUMMARISE[i % len(SUMMARISE)]}\n\n{body}"}
        )
    for _ in range(30):  # RAG: numbered documents from anywhere, a question about one of them
        docs = rng.sample(chunks, rng.randint(2, 4))
        while sum(len(d[2]) for d in docs) < 3500:
            docs.append(rng.choice(chunks))
        asked = rng.choice(docs)
        body = "\n\n".join(f"[Document {k + 1}] ({d[0]}, {d[1]})\n{d[2]}" for k, d in enumerate(docs))
        question = (
            f'Using only the documents above, explain what they say about "{asked[1]}", and name the '
            "document numbers you used."
        )
        records.append({"category": "long_rag", "prompt": f"{body}\n\nQuestion: {question}"})
    for _ in range(
        12
    ):  # multi-turn: a document, then follow-ups (bench answers each turn with plain decoding)
        start = rng.randrange(len(chunks) - 6)
        body = "\n\n".join(c[2] for c in packed(chunks, start, rng.randint(3000, 6500)))
        turns = [f"Here is part of a project's documentation.\n\n{body}\n\nWhat is this part about?"]
        turns += rng.sample(FOLLOW_UPS, 3)
        records.append({"category": "long_multiturn", "turns": turns})
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "inference" / "bench_prompts_long_eval.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = load_target(TargetConfig(device="cpu"), with_model=False).tokenizer
    kept = []
    for r in build(args.seed):
        first = r.get("prompt") or r["turns"][0]
        n = len(
            tok(tok.apply_chat_template([{"role": "user", "content": first}], tokenize=False))["input_ids"]
        )
        if (
            MIN_TOKENS <= n <= MAX_TOKENS
            and sum(k["category"] == r["category"] for k in kept) < PER_KIND[r["category"]]
        ):
            kept.append({**r, "prompt_tokens": n})
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in kept))
    counts = {c: sum(r["category"] == c for r in kept) for c in sorted({r["category"] for r in kept})}
    lengths = sorted(r["prompt_tokens"] for r in kept)
    print(f"wrote {len(kept)} prompts to {args.out}: {counts}; first-turn tokens {lengths[0]}..{lengths[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
