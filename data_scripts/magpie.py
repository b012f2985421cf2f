"""Prompt-free data: the target writes the user's question itself (Magpie-style).

Given its chat template up to the start of a user message, an instruction-tuned model samples a
plausible user request. Those requests, answered by the same target, are in its own distribution.
"""

from __future__ import annotations

from typing import Optional

from headway.data_scripts.config import MagpieConfig
from headway.data_scripts.engines import Engine, ProgressFn, SamplingSettings
from headway.target.chat import ChatFormat


def write_prompts(
    engine: Engine,
    fmt: ChatFormat,
    cfg: MagpieConfig,
    count: int,
    seed: int,
    progress: Optional[ProgressFn] = None,
) -> list[Optional[str]]:
    """`count` self-written user prompts; None where a sample was unfinished, too short or a
    duplicate."""
    prefix = fmt.user_prefix()
    settings = SamplingSettings(cfg.max_prompt_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    gens = engine.generate([prefix] * count, settings, seed, progress)
    seen: set[str] = set()
    out: list[Optional[str]] = []
    for g in gens:
        text = (
            fmt.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip()
            if g.finished
            else ""
        )
        if len(text) < cfg.min_chars or text in seen:
            out.append(None)
            continue
        seen.add(text)
        out.append(text)
    return out
