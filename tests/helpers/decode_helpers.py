"""Tiny targets loaded for exactness tests, chat prompts for them, and a run of every kind of engine
step."""

from __future__ import annotations

from pathlib import Path

import torch

from headway.config import load_config
from headway.inference.engines.tree import build_tree
from headway.run_config import RunConfig
from headway.target.config import TargetConfig
from headway.target.cpu_format import fastest_cpu_format
from headway.target.loading import load_target


def fast_format() -> tuple[str, str]:
    """(dtype, linear_weights) a decoding command takes on this CPU for a target left at `auto`
    (target/cpu_format.py; tests/target/test_cpu_format.py pins its choice for every kind of
    CPU)."""
    t, _ = fastest_cpu_format(TargetConfig(device="cpu"))
    return t.dtype, t.linear_weights


def with_threads(n: int, fn):
    """fn() run with torch set to n threads, then the thread count as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def load64(path: Path):
    """A tiny target in float64 on one CPU thread: exactness tests compare tokens, not rounding."""
    return load_target(
        TargetConfig(name_or_path=str(path), device="cpu", num_threads=1, dtype="float64")
    )


def float64_run(target_dir: Path, *extra: str) -> RunConfig:
    """The run config that decodes a trained head on tiny target `target_dir` in float64 on the CPU,
    with `extra` overrides."""
    return load_config(
        RunConfig,
        None,
        [f"target.name_or_path={target_dir}", "target.device=cpu", "target.dtype=float64", *extra],
    )


def load_packed(path: Path, linear_weights: str = "float16", dtype: str = "float32"):
    """A tiny target on one CPU thread with its linear weights in a packed CPU format
    (target/packed_*.py)."""
    return load_target(
        TargetConfig(
            name_or_path=str(path),
            device="cpu",
            num_threads=1,
            dtype=dtype,
            linear_weights=linear_weights,
        )
    )


def chat_ids(t, text: str) -> list[int]:
    """The prompt ids of one user turn through the target's chat template."""
    prompt = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return t.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def engine_steps(runner, more: int = 0) -> list[torch.Tensor]:
    """A prompt, one-token steps, tree steps with their compaction, then `more` one-token steps, on
    a static
    runner: each step's logits (stacked by row) and hidden states, as one list of tensors to compare
        bit
    for bit."""
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    out = []
    for ids, t, keep in [
        (torch.arange(10, 40), None, None),
        (torch.tensor([11]), None, None),
        (torch.tensor([5, 6, 7, 8, 9, 10]), tree, [0, 1, 3]),
        (torch.tensor([12]), None, None),
        (torch.tensor([3, 4, 5, 6, 7, 8]), tree, [0, 2, 4, 5]),
        (torch.tensor([13, 14]), None, None),
        *[(torch.tensor([20 + i]), None, None) for i in range(more)],
    ]:
        logits, hidden = runner.forward(ids, t, hidden=True)
        out += [torch.stack([logits[i] for i in range(len(logits))]), *hidden]
        if keep:
            runner.keep(t.size, keep)
    return out
