"""Greedy speculative decoding on the CUDA backend: the drafter proposes on the device, the runner
verifies and accepts on the device, and each step reads the host once.

A step: the drafter's `draft_tensors(root)` gives the tree's node ids and parent indices as device
tensors (the static trees of Medusa and DFlash, the EAGLE expansion); `CudaRunner.step` verifies
them and runs greedy acceptance on the device; `CudaRunner.read` brings back the verdict (accepted
count, bonus token, path, the path's tokens): the step's one device-to-host read; the cache keeps
the path by one gather-copy, the drafter reads the accepted tokens with the target's features
(gathered on the device), and the bonus token, still on the device, roots the next tree. The tokens
are exactly plain greedy decoding's on the same engine.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol

import torch

from headway.inference.config import SamplingConfig
from headway.inference.engines.cuda.runner import CudaRunner, pinned_sdpa
from headway.inference.engines.distribution import target_distribution


def device_features(states: list, layers: list[int], rows: torch.Tensor) -> torch.Tensor:
    """The drafter's features [k, F] at step rows `rows` [k] (device), from the step's hidden states
    (each [m, H], transformers' output_hidden_states order)."""
    if not layers:
        return torch.empty(0, 0)
    return torch.cat([states[i].index_select(0, rows) for i in layers], dim=-1)


class DeviceDrafter(Protocol):
    """What the device loop needs of a drafter (generate.Drafter with `drafts_on_device`)."""

    feature_layers: list[int]

    def reserve(self, max_len: int, graphs: Optional[bool] = None) -> None:
        """Size what it keeps on the device for sequences of up to `max_len` tokens, once, before
        `begin`."""

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        """A new sequence (generate.Drafter.begin)."""

    def draft_tensors(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """root [1] (a device tensor) -> the tree's node ids [n] and parent indices [n] (-1: the
        root)."""

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        """The verified step (generate.Drafter.accept)."""


def device_loop(
    runner: CudaRunner,
    drafter: DeviceDrafter,
    prompt: list[int],
    max_new_tokens: int,
    stops: set[int],
    finish: Any,
    result: Any,
    sampling: Optional[SamplingConfig] = None,
) -> Any:
    """The loop (see the module docstring): `finish` cuts the new tokens at a stop token or the
    budget (generate._finish), `result` builds the GenerationResult; `sampling` at temperature > 0:
    tree rejection sampling on the device (accept_device.sample_accept), its uniforms drawn before
    each step from a device generator seeded with sampling.seed. The drafter's attention runs, like
    the steps', without cuDNN's SDPA (`pinned_sdpa`, scoped to the loop: the process's own setting
    is left as it was)."""
    with pinned_sdpa():
        return _device_loop(
            runner, drafter, prompt, max_new_tokens, stops, finish, result, sampling
        )


def _device_loop(
    runner: CudaRunner,
    drafter: DeviceDrafter,
    prompt: list[int],
    max_new_tokens: int,
    stops: set[int],
    finish: Any,
    result: Any,
    sampling: Optional[SamplingConfig],
) -> Any:
    layers = drafter.feature_layers
    start = time.perf_counter()
    cfg = sampling or SamplingConfig()
    runner.set_sampling(cfg)
    uniforms = None
    if not cfg.greedy:
        gen = torch.Generator(device=runner.device).manual_seed(cfg.seed)

        def uniforms(k: int) -> torch.Tensor:
            return torch.rand(k, generator=gen, dtype=torch.float64, device=runner.device)

    drafter.reserve(runner.max_len, runner.graphs.enabled)
    logits, hidden = runner.forward(torch.tensor(prompt), hidden=bool(layers))
    if uniforms is None:
        root_dev = logits[-1].argmax().view(1)  # argmax: the first max, as plain decoding's
    else:
        cumulative = target_distribution(logits[-1], cfg).cumsum(0)
        root_dev = torch.searchsorted(cumulative, uniforms(1) * cumulative[-1:], right=True)
        root_dev = root_dev.clamp(max=cumulative.shape[0] - 1)
    root = runner.read(root_dev)[0]  # the prompt's one read
    drafter.begin(
        prompt, root, torch.cat([hidden[i][0] for i in layers], -1) if layers else torch.empty(0, 0)
    )
    out, done = finish([root], stops, max_new_tokens)
    forwards, accepted_counts = 0, []
    t_draft = t_verify = 0.0
    while not done:
        t0 = time.perf_counter()
        nodes, parent = drafter.draft_tensors(root_dev)
        t1 = time.perf_counter()
        n = nodes.shape[0]
        if uniforms is not None:  # outside the step: a captured step reads them from its buffer
            runner.buf.uniforms.copy_(uniforms(runner.buf.uniforms.shape[0]))
        _, states, verdict = runner.step(nodes, parent, n)
        m = verdict.shape[0] // 2 - 1
        host = runner.read(verdict)  # the step's one device-to-host read
        forwards += 1
        t2 = time.perf_counter()
        a, bonus = host[0], host[1]
        path = verdict[2 : 3 + a]
        runner.keep_path(n, path)
        new = host[2 + m + 1 : 2 + m + 1 + a] + [bonus]
        accepted_counts.append(a)
        t3 = time.perf_counter()
        drafter.accept(new, device_features(states, layers, path))
        # the verdict is the step graph's memory, rewritten next step
        root_dev = verdict[1:2].clone()
        t_draft += (t1 - t0) + (time.perf_counter() - t3)
        t_verify += t2 - t1
        new, done = finish(new, stops, max_new_tokens - len(out))
        out += new
    return result(
        out, forwards, time.perf_counter() - start, accepted_counts, t_draft, t_verify, {}
    )
