"""Tiny targets loaded for exactness tests, and chat prompts for them."""

from __future__ import annotations

from pathlib import Path

from headway.target.config import TargetConfig
from headway.target.loading import load_target


def load64(path: Path):
    """A tiny target in float64 on one CPU thread: exactness tests compare tokens, not rounding."""
    return load_target(TargetConfig(name_or_path=str(path), device="cpu", num_threads=1, dtype="float64"))


def load_packed(path: Path, linear_weights: str = "float16", dtype: str = "float32"):
    """A tiny target on one CPU thread with its linear weights in a packed CPU format (target/packed_linear.py)."""
    return load_target(
        TargetConfig(
            name_or_path=str(path), device="cpu", num_threads=1, dtype=dtype, linear_weights=linear_weights
        )
    )


def chat_ids(t, text: str) -> list[int]:
    """The prompt ids of one user turn through the target's chat template."""
    prompt = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
