"""Build long-prompt sets: the evaluation set (inference/bench/prompts/long_eval.jsonl) or a
training prompt file.

Long prompts are where drafts drift. The set has three kinds, each prompt 1,000-3,000 tokens of the
default target's tokenizer (first turn): summarisation of a stretch of one document, RAG-style
questions over several numbered documents, and multi-turn chat that starts from a document and asks
follow-ups. The documents are Headway's own (docs/*.md, README.md, CHANGELOG.md), so the set can
ship with Headway; the choice is seeded, and the file was written once and committed (rerunning on
later docs gives another set).

Training prompts (`--source stdlib`) are built the same way from another corpus, the documentation
of Python's standard library as pydoc renders it on this machine, so they share no text with the
evaluation set; the target answers them in `headway distill` (docs/training.md, "Long prompts").

    python tools/make_long_prompts.py [--out inference/bench/prompts/long_eval.jsonl] [--seed 0]
    python tools/make_long_prompts.py --source stdlib --out long_train.jsonl --per-kind 48,48,32 --seed 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import pydoc
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
PER_KIND = {
    "long_summarization": 16,
    "long_rag": 16,
    "long_multiturn": 12,
}  # the first that fit, per kind
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


# Standard-library modules whose pydoc pages make the training corpus (prose and API text, like a
# user's docs).
STDLIB = (
    "argparse asyncio bisect calendar collections configparser contextlib csv dataclasses datetime decimal "
    "difflib email.message enum fractions functools glob gzip hashlib heapq html.parser http.client "
    "inspect itertools json logging multiprocessing operator pathlib pickle pprint queue random re sched "
    "secrets selectors shutil socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap "
    "threading timeit tokenize traceback types typing unittest urllib.parse uuid warnings weakref "
    "xml.etree.ElementTree zipfile zlib"
).split()


def documents(source: str) -> list[tuple[str, str]]:
    """(name, text) of each document of a corpus: Headway's docs, or pydoc's plain-text pages of
    the stdlib."""
    if source == "docs":
        return [(name, (ROOT / name).read_text()) for name in SOURCES]
    docs = []
    for name in STDLIB:
        page = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        page = re.sub(r".\x08", "", page)  # pydoc's overstrike bold
        # pydoc's sections ("CLASSES", "FUNCTIONS") and each class become headings the splitter
        # below knows.
        page = re.sub(r"\n([A-Z][A-Z ]+)\n", r"\n## \1\n", page)
        page = re.sub(r"\n {4}class (\w+)", r"\n### class \1", page)
        docs.append((name, page))
    return docs


def sections(source: str = "docs") -> list[tuple[str, str, str]]:
    """(file, heading, text) for every section of the sources, long sections cut at paragraph
    boundaries."""
    out = []
    for name, text in documents(source):
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


def packed(
    chunks: list[tuple[str, str, str]], start: int, chars: int
) -> list[tuple[str, str, str]]:
    """Consecutive chunks from `start` until about `chars` characters."""
    picked, total = [], 0
    for chunk in chunks[start:]:
        if total > chars:
            break
        picked.append(chunk)
        total += len(chunk[2])
    return picked


def build(
    seed: int, source: str = "docs", candidates: tuple[int, int, int] = (30, 30, 12)
) -> list[dict]:
    """Candidate records per kind (summarisation, RAG, multi-turn); `main` keeps those that fit the
    window.

    The default counts are the ones the committed evaluation set was drawn with, so a rerun on the
    same docs writes the same file."""
    rng = random.Random(seed)
    chunks = sections(source)
    what = (
        "part of a project's documentation"
        if source == "docs"
        else "part of a library's documentation"
    )
    records: list[dict] = []
    for i in range(candidates[0]):  # summarisation: a stretch of one file
        start = rng.randrange(len(chunks) - 6)
        body = "\n\n".join(c[2] for c in packed(chunks, start, rng.randint(3000, 7000)))
        records.append(
            {
                "category": "long_summarization",
                "prompt": f"{SUMMARISE[i % len(SUMMARISE)]}\n\n{body}",
            }
        )
    for _ in range(
        candidates[1]
    ):  # RAG: numbered documents from anywhere, a question about one of them
        docs = rng.sample(chunks, rng.randint(2, 4))
        while sum(len(d[2]) for d in docs) < 3500:
            docs.append(rng.choice(chunks))
        asked = rng.choice(docs)
        body = "\n\n".join(
            f"[Document {k + 1}] ({d[0]}, {d[1]})\n{d[2]}" for k, d in enumerate(docs)
        )
        question = (
            f'Using only the documents above, explain what they say about "{asked[1]}", and name the '
            "document numbers you used."
        )
        records.append({"category": "long_rag", "prompt": f"{body}\n\nQuestion: {question}"})
    for _ in range(
        candidates[2]
    ):  # multi-turn: a document, then follow-ups (bench answers each turn plainly)
        start = rng.randrange(len(chunks) - 6)
        body = "\n\n".join(c[2] for c in packed(chunks, start, rng.randint(3000, 6500)))
        turns = [f"Here is {what}.\n\n{body}\n\nWhat is this part about?"]
        turns += rng.sample(FOLLOW_UPS, 3)
        records.append({"category": "long_multiturn", "turns": turns})
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=str(ROOT / "inference" / "bench" / "prompts" / "long_eval.jsonl")
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--source",
        choices=("docs", "stdlib"),
        default="docs",
        help="docs: evaluation; stdlib: training",
    )
    ap.add_argument(
        "--per-kind",
        default=",".join(str(v) for v in PER_KIND.values()),
        help="prompts kept per kind: summarisation,RAG,multi-turn",
    )
    args = ap.parse_args()
    wanted = dict(zip(PER_KIND, (int(v) for v in args.per_kind.split(",")), strict=True))
    tok = load_target(TargetConfig(device="cpu"), with_model=False).tokenizer
    kept = []
    candidates = (30, 30, 12) if args.source == "docs" else tuple(3 * v for v in wanted.values())
    for r in build(args.seed, args.source, candidates):
        first = r.get("prompt") or r["turns"][0]
        n = len(
            tok(tok.apply_chat_template([{"role": "user", "content": first}], tokenize=False))[
                "input_ids"
            ]
        )
        if (
            MIN_TOKENS <= n <= MAX_TOKENS
            and sum(k["category"] == r["category"] for k in kept) < wanted[r["category"]]
        ):
            kept.append({**r, "prompt_tokens": n})
    if (
        args.source != "docs"
    ):  # a training prompt file: one field for every record, as `headway distill` reads
        kept = [
            {"category": r["category"], "turns": r.get("turns") or [r["prompt"]], **r} for r in kept
        ]
        kept = [{k: v for k, v in r.items() if k != "prompt"} for r in kept]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in kept))
    counts = {
        c: sum(r["category"] == c for r in kept) for c in sorted({r["category"] for r in kept})
    }
    lengths = sorted(r["prompt_tokens"] for r in kept)
    print(
        f"wrote {len(kept)} prompts to {args.out}: {counts}; first-turn tokens {lengths[0]}..{lengths[-1]}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
