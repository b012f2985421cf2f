"""Greedy speculative decoding on the CUDA backend: the drafter proposes on the device, the runner verifies
and accepts on the device, and each step reads the host once.

A step: the drafter's `draft_tensors(root)` gives the tree's node ids and parent indices as device tensors
(the static trees of Medusa and DFlash, the EAGLE expansion); `CudaRunner.step` verifies them and runs greedy
acceptance on the device; `CudaRunner.read` brings back the verdict (accepted count, bonus token, path, the
path's tokens): the step's one device-to-host read; the cache keeps the path by one gather-copy, the drafter
reads the accepted tokens with the target's features (gathered on the device), and the bonus token, still on
the device, roots the next tree. The tokens are exactly plain greedy decoding's on the same engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from headway.inference.engine_cuda import CudaRunner


def device_features(states: list, layers: list[int], rows: torch.Tensor) -> torch.Tensor:
    """The drafter's features [k, F] at step rows `rows` [k] (device), from the step's hidden states (each
    [m, H], transformers' output_hidden_states order)."""
    if not layers:
        return torch.empty(0, 0)
    return torch.cat([states[i].index_select(0, rows) for i in layers], dim=-1)


def device_loop(
    runner: CudaRunner,
    drafter: Any,
    prompt: list[int],
    max_new_tokens: int,
    stops: set[int],
    finish: Any,
    result: Any,
) -> Any:
    """The greedy loop (see the module docstring): `finish` cuts the new tokens at a stop token or the budget
    (generate._finish), `result` builds the GenerationResult."""
    layers = drafter.feature_layers
    start = time.perf_counter()
    if hasattr(drafter, "reserve"):  # a drafter with a device cache of its own sizes it once
        drafter.reserve(runner.max_len, runner.graphs.enabled)
    logits, hidden = runner.forward(torch.tensor(prompt), hidden=bool(layers))
    root_dev = logits[-1].argmax().view(1)  # argmax: the first max, as plain decoding's
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
        root_dev = verdict[1:2].clone()  # the verdict is the step graph's memory, rewritten next step
        t_draft += (t1 - t0) + (time.perf_counter() - t3)
        t_verify += t2 - t1
        new, done = finish(new, stops, max_new_tokens - len(out))
        out += new
    return result(out, forwards, time.perf_counter() - start, accepted_counts, t_draft, t_verify, {})
