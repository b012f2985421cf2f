"""The decoding loops: plain decoding (the reference), and speculative decoding over a tree.

Speculative step: the drafter builds a tree rooted at the token the target just produced (a static
Medusa tree or an EAGLE-2 dynamic one); one target forward on the engine's runner
(engines/runner.py) verifies every node (tree mask, explicit positions, its KV cache); an acceptance
rule walks the tree from the root (greedy: the longest path of the target's own argmax choices;
sampling: tree rejection sampling, see sampling.py) and gives the target's next token after the
    accepted path (the bonus); the cache keeps
only the accepted path, and the drafter is told what was accepted with the target's features there.
Greedy output is exactly plain greedy decoding's; sampled output has exactly its distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

import torch

from headway.errors import HeadwayError
from headway.inference.engines.cuda.loop import device_loop
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.runner import make_runner
from headway.inference.engines.tree import Tree
from headway.inference.sampling import Sampler, SamplingConfig, acceptance_rule

GREEDY = SamplingConfig()


class Drafter(Protocol):
    """What the decoding loops need of a drafter (drafters/): the loops never ask which drafter it
    is."""

    feature_layers: list[int]  # the target hidden states (HF output_hidden_states indices) it reads
    max_nodes: int  # the most nodes (root included) a tree of its can have
    max_depth: int  # the deepest a tree of its can go
    # it also drafts on the device (engines/cuda/loop.py `DeviceDrafter`: draft_tensors, reserve),
    # so the CUDA backend's loop can run it with one host read a step
    drafts_on_device: bool
    # per node of its last tree, the kind of branch that proposed it (the hybrid's: neural, ngram),
    # or None
    node_sources: Optional[list[str]]

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        """A new sequence: the prompt, the target's first token, and the features [len(prompt), F]
        of the prompt."""

    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        """Token ids of every tree node (root first) and the tree itself."""

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        """The verified step: accepted drafts plus the bonus token, and the target's features
        [len(tokens), F] at the root and the accepted nodes (the positions that produced those
        tokens)."""


def features_at(hidden_states: tuple, layers: list[int], positions: Any) -> torch.Tensor:
    """Concatenated target features [n, F] of batch row 0 at `positions` (an empty tensor for a
    drafter that reads none: the target then skips collecting them)."""
    if not layers:
        return torch.empty(0, 0)
    return torch.cat([hidden_states[i][0, positions] for i in layers], dim=-1)


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens, ending with a stop token or at max_new_tokens
    target_forwards: int  # target forward passes after the prefill
    seconds: float
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted at each verification
    draft_seconds: float = 0.0  # in the drafter (drafting the tree, reading the accepted tokens)
    verify_seconds: float = 0.0  # in target forwards after the prefill (the tree verifications)
    # accepted draft tokens by the kind of branch that proposed them (hybrid drafters: neural,
    # ngram, both)
    sources: dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Tokens per target forward in the decoding phase (accepted drafts + the bonus token)."""
        return (len(self.tokens) - 1) / self.target_forwards if self.target_forwards else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def alternate(runners: dict[str, Any], ids: list[int], i: int) -> dict[str, GenerationResult]:
    """Every runner on the same prompt ids, starting from a different one for each prompt index i,
    so that a slow spell of the machine hits every method alike."""
    names = list(runners)
    k = i % len(names)
    return {n: runners[n](ids) for n in names[k:] + names[:k]}


def pooled(results: list[GenerationResult]) -> dict:
    """Tokens/s and tau over several generations (totals, not a mean of per-prompt rates)."""
    tokens = sum(len(r.tokens) for r in results)
    return {
        "tok_s": tokens / max(1e-9, sum(r.seconds for r in results)),
        "tau": (tokens - len(results)) / max(1, sum(r.target_forwards for r in results)),
    }


def _check_length(model: Any, prompt_len: int, max_new_tokens: int, tree_size: int) -> None:
    """Refuse requests the target cannot serve: past its context. (A sliding window limits nothing:
    every engine that runs one keeps the keys a tree may need and masks the window per row.)"""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos and prompt_len + max_new_tokens + tree_size > max_pos:
        raise HeadwayError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the target's context ({max_pos})"
        )


def _finish(tokens: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut at the first stop token or at max_new_tokens; the bool says whether generation is
    over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.inference_mode()
def plain_generate(
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    sampling: SamplingConfig = GREEDY,
    engine: Union[str, EngineOptions] = "auto",
) -> GenerationResult:
    """Plain decoding with the same engine (one target forward per token): greedy, or sampled.

    Args:
        model, prompt, max_new_tokens, stop_ids, sampling, engine: as in `speculative_generate`.
    Returns:
        GenerationResult with `target_forwards` = tokens - 1: the reference speculative decoding
        must equal."""
    _check_length(model, len(prompt), max_new_tokens, 1)
    sampler = Sampler(sampling)
    start = time.perf_counter()
    runner = make_runner(model, len(prompt) + max_new_tokens, engine, rows=1)
    logits, _ = runner.forward(torch.tensor(prompt))
    out = [sampler.next_token(logits[-1])]
    forwards = 0
    stops = set(stop_ids)
    while len(out) < max_new_tokens and out[-1] not in stops:
        logits, _ = runner.forward(torch.tensor([out[-1]]))
        forwards += 1
        out.append(sampler.next_token(logits[-1]))
    return GenerationResult(out, forwards, time.perf_counter() - start, [])


def greedy_generate(
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    engine: Union[str, EngineOptions] = "auto",
) -> GenerationResult:
    """Plain greedy decoding: the reference every speculative greedy output must equal."""
    return plain_generate(model, prompt, max_new_tokens, stop_ids, engine=engine)


@torch.inference_mode()
def speculative_generate(
    model: Any,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    sampling: SamplingConfig = GREEDY,
    rule: Any = None,
    engine: Union[str, EngineOptions] = "auto",
) -> GenerationResult:
    """Speculative decoding over the drafter's trees: greedy gives exactly plain_generate's tokens,
    sampling exactly its distribution (with acceptance=exact).

    Args:
        model: the target (a transformers causal LM, eval mode).
        drafter: proposes a tree each step (`draft(root) -> (node ids [n], Tree)`) and reads what
            was accepted (`accept(tokens, features [k, F])`); its `feature_layers` name the target
            hidden states it reads.
        prompt: the prompt's token ids.
        max_new_tokens: the most tokens to write; stop_ids: tokens that end the answer (kept in it).
        sampling: temperature 0 (greedy) or a sampling config; the same one plain decoding uses.
        rule: overrides the acceptance rule (tests).
        engine: the target's forward (auto, static, compiled, cuda, hf) with the default settings,
            or the EngineOptions to run it with; plain decoding must use the same one. The CUDA
            backend runs every step in one exact row bucket unless the options name others
            (engine_options.EXACT_BUCKETS).
    Returns:
        GenerationResult: the new tokens, target forwards after the prefill, seconds, and the
            accepted drafts
        per step."""
    _check_length(model, len(prompt), max_new_tokens, drafter.max_nodes)
    stops = set(stop_ids)
    layers = drafter.feature_layers
    sampler = Sampler(sampling)
    own_rule, rule = rule is not None, rule or acceptance_rule(sampling)
    start = time.perf_counter()
    runner = make_runner(
        model, len(prompt) + max_new_tokens + drafter.max_nodes, engine, rows=drafter.max_nodes
    )
    lossless = sampling.greedy or sampling.acceptance == "exact"
    if runner.accepts_on_device and lossless and not own_rule and drafter.drafts_on_device:
        # the CUDA backend's loop: drafting, verification and acceptance on the device, one read a
        # step
        return device_loop(
            runner, drafter, prompt, max_new_tokens, stops, _finish, GenerationResult, sampling
        )
    logits, hidden = runner.forward(torch.tensor(prompt), hidden=bool(layers))
    root = sampler.next_token(logits[-1])
    drafter.begin(prompt, root, features_at(hidden, layers, slice(None)))
    out, done = _finish([root], stops, max_new_tokens)
    forwards, accepted_counts, sources = 0, [], {}
    t_draft = t_verify = 0.0
    while not done:
        t0 = time.perf_counter()
        nodes, tree = drafter.draft(root)
        t1 = time.perf_counter()
        logits, hidden = runner.forward(nodes, tree, hidden=bool(layers))
        forwards += 1
        t2 = time.perf_counter()
        node_ids = nodes.tolist()
        path, bonus = rule(tree, node_ids, logits, sampler)
        runner.keep(tree.size, path)
        new = [node_ids[i] for i in path[1:]] + [bonus]
        kinds = drafter.node_sources
        for i in path[1:] if kinds else ():
            sources[kinds[i]] = sources.get(kinds[i], 0) + 1
        accepted_counts.append(len(path) - 1)
        t3 = time.perf_counter()
        drafter.accept(new, features_at(hidden, layers, path))
        t_draft += (t1 - t0) + (time.perf_counter() - t3)
        t_verify += t2 - t1
        new, done = _finish(new, stops, max_new_tokens - len(out))
        out += new
        root = bonus
    return GenerationResult(
        out, forwards, time.perf_counter() - start, accepted_counts, t_draft, t_verify, sources
    )
