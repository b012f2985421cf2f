"""A decoder run under one of Headway's registered attention implementations for a `with` block.

transformers looks a layer's attention function up by `config._attn_implementation` at every call,
so setting it on the decoder's config for the block's duration, and restoring it after, changes how
that decoder attends and nothing else (train/ttt.py, train/ttt_flex.py, train/ttt_recompute.py
register theirs).
"""

from __future__ import annotations

from typing import Any, Optional


class UnderAttention:
    """Runs `decoder` under the attention implementation `name` inside a `with` block."""

    def __init__(self, decoder: Any, name: str):
        self.config, self.name = decoder.config, name
        self.saved: Optional[str] = None

    def __enter__(self) -> "UnderAttention":
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = self.name
        return self

    def __exit__(self, *exc: Any) -> None:
        self.config._attn_implementation = self.saved
