"""Prompt-free data: the target writes the user's question itself (Magpie-style).

Given its chat template up to the start of a user message, an instruction-tuned model samples a
plausible user request. Those requests, answered by the same target, are in its own distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from headway.data_scripts.chat import ChatFormat
from headway.data_scripts.engines import Engine, ProgressFn, SamplingSettings


@dataclass
class MagpieConfig:
    # How many user prompts the target writes itself; used when prompts.path is null.
    num_prompts: int = 0
    # Sampling for the questions: high temperature gives varied requests.
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    # A question longer than this is unfinished and dropped.
    max_prompt_tokens: int = 128
    # Drop questions shorter than this many characters (fragments, greetings).
    min_chars: int = 12


def write_prompts(
    engine: Engine,
    fmt: ChatFormat,
    cfg: MagpieConfig,
    count: int,
    seed: int,
    progress: Optional[ProgressFn] = None,
) -> list[Optional[str]]:
    """`count` self-written user prompts; None where a sample was unfinished, too short or a duplicate."""
    prefix = fmt.user_prefix()
    settings = SamplingSettings(cfg.max_prompt_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    gens = engine.generate([prefix] * count, settings, seed, progress)
    seen: set[str] = set()
    out: list[Optional[str]] = []
    for g in gens:
        text = fmt.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip() if g.finished else ""
        if len(text) < cfg.min_chars or text in seen:
            out.append(None)
            continue
        seen.add(text)
        out.append(text)
    return out
