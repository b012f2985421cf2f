"""Peers that `headway bench` runs beside Headway: Hugging Face `generate`, plain and with prompt
lookup.

Both decode the same target object with the same prompt ids, stop tokens, max_new_tokens and
sampling settings as Headway's own plain decoding, so their outputs are comparable token for token
(greedy).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from headway.inference.generate import GenerationResult, _finish
from headway.inference.sampling import SamplingConfig


def _generation_config(
    max_new_tokens: int, stop_ids: list[int], sampling: SamplingConfig, **extra: Any
) -> Any:
    from transformers import GenerationConfig

    kw: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": list(stop_ids),
        "pad_token_id": stop_ids[0],
    }
    if sampling.greedy:
        kw["do_sample"] = False
    else:
        kw.update(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k or None,
            top_p=sampling.top_p,
        )
    return GenerationConfig(**kw, **extra)


@torch.inference_mode()
def hf_generate(
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    sampling: SamplingConfig,
    prompt_lookup_tokens: int = 0,
    prompt_lookup_max_ngram: int = 2,
) -> GenerationResult:
    """`model.generate` on one prompt; `prompt_lookup_tokens` > 0 turns on its prompt-lookup
    decoding (n-gram drafts copied from the prompt and the text so far, verified by the target)."""
    device = next(model.parameters()).device
    extra = (
        {
            "prompt_lookup_num_tokens": prompt_lookup_tokens,
            "max_matching_ngram_size": prompt_lookup_max_ngram,
        }
        if prompt_lookup_tokens > 0
        else {}
    )
    gen_cfg = _generation_config(max_new_tokens, stop_ids, sampling, **extra)
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
    ids = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    seconds = time.perf_counter() - start
    tokens, _ = _finish(out[0, len(prompt) :].tolist(), set(stop_ids), max_new_tokens)
    return GenerationResult(tokens, 0, seconds)
