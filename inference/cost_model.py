"""The runtime cost model: what one verification step costs on this machine, measured on the
decoding engine.

The hybrid drafter sizes its tree from these curves each step, and `headway tune` prices candidate
trees with them. A row-exact engine's cost also depends on the tree's depth (`depth_matters`): there
the model interpolates between a chain and a flat tree. The CUDA backend's cost is a step function,
one value per row
bucket (`bucket_costs`): on a GPU 64 rows cost about what one does, so tune and the hybrid pick
    larger trees.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from headway.heads.draft_layer import text_config
from headway.inference.config import TREE_SIZES
from headway.inference.engines.cuda.graphs import WARMUP
from headway.inference.engines.cuda.runner import CudaRunner
from headway.inference.engines.options import EngineOptions, as_options
from headway.inference.engines.runner import engine_name, make_runner
from headway.inference.engines.tree import build_tree
from headway.inference.sampling import Sampler, SamplingConfig, acceptance_rule, greedy_token
from headway.target.packed_model import linear_weights

log = logging.getLogger("headway")

# The verified-token counts a curve is measured at (besides its last): the tree sizes tune scores,
# as tokens, up to the largest tree's 64 with its root.
CURVE_TOKENS = (*TREE_SIZES[:-1], TREE_SIZES[-1] + 1)


def machine_key(model: Any, engine: str = "auto") -> dict:
    """What a tuned setting is only valid for: the device, the processor, the thread count, the
    dtype (and the linear weights' format, when packed) and the decoding engine."""
    p = next(model.parameters())
    if p.device.type == "cuda":
        name = torch.cuda.get_device_name(p.device)
    else:
        name = _cpu_name()
    key = {
        "device": p.device.type,
        "processor": name,
        "threads": torch.get_num_threads(),
        "dtype": str(p.dtype),
        "engine": engine_name(model, engine),
    }
    if linear_weights(model) != "native":
        key["linear_weights"] = linear_weights(model)
    return key


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------- cost on this machine


@torch.inference_mode()
def verify_cost(
    model: Any,
    sizes: list[int],
    prefix_len: int,
    repeats: int,
    engine: Union[str, EngineOptions] = "auto",
    shape: str = "chain",
) -> dict[int, float]:
    """Seconds of one verification step over n tree tokens after a cache of prefix_len tokens, for
    each n in
    sizes: the fastest of `repeats` (another process or a timer tick only adds time, and a tree's
        size is
    chosen from ratios between these). A step is the target forward (with hidden states) on the
    decoding engine, the greedy acceptance walk and the cache compaction, as speculative_generate
    does them. n = 1 is plain decoding's step. The tree is a chain (`shape` chain: the deepest) or
    the root's children (flat): only a row-exact engine's cost depends on which
    (`depth_matters`)."""
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    runner = make_runner(model, prefix_len + max(sizes) + 1, engine, rows=max(sizes))
    runner.forward(torch.randint(vocab, (prefix_len,), generator=gen))
    if runner.accepts_on_device:
        return bucket_costs(
            runner, sizes, prefix_len, repeats, torch.randint(vocab, (max(sizes),), generator=gen)
        )
    greedy, rule = Sampler(SamplingConfig()), acceptance_rule(SamplingConfig())
    out: dict[int, float] = {}
    for n in sorted(set(sizes)):
        tree = build_tree(
            [[0] * d for d in range(1, n)] if shape == "chain" else [[i] for i in range(n - 1)]
        )
        ids = torch.randint(vocab, (n,), generator=gen)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            if n == 1:
                greedy_token(runner.forward(ids)[0][-1])
            else:
                logits, _ = runner.forward(ids, tree, hidden=True)
                path, _ = rule(tree, ids.tolist(), logits, greedy)
                runner.keep(n, path)
            _sync(device)
            times.append(time.perf_counter() - t0)
            runner.truncate(prefix_len)
        out[n] = min(times[1:])
    return out


def bucket_costs(
    runner: CudaRunner, sizes: list[int], prefix_len: int, repeats: int, ids: torch.Tensor
) -> dict[int, float]:
    """The CUDA backend's verification cost: a step function of the node count, one value per row
    bucket (a tree of n nodes runs as its bucket's step). Each bucket is timed as the device loop
    runs it (the step, the verdict's read, the path kept), after the warm-up that captures its
    graph; the curve holds every n from 1 to max(sizes), so interpolating it keeps the steps."""
    per_bucket: dict[int, float] = {}
    for m in sorted({runner.bucket(n) for n in sizes}):
        # (any n of the bucket runs the same step)
        n = max(k for k in sizes if runner.bucket(k) == m)
        parent = torch.arange(-1, n - 1)  # a chain: on this backend the tree's shape costs nothing
        times = []
        for _ in range(WARMUP + 1 + repeats):
            _sync(runner.device)
            t0 = time.perf_counter()
            _, _, verdict = runner.step(ids[:n], parent, n)
            runner.read(verdict)
            runner.keep_path(n, verdict[2:3])
            _sync(runner.device)
            times.append(time.perf_counter() - t0)
            runner.truncate(prefix_len)
        per_bucket[m] = statistics.median(times[WARMUP + 1 :])
    return {n: per_bucket[runner.bucket(n)] for n in range(1, max(sizes) + 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interpolate(costs: dict[int, float], n: int) -> float:
    """Linear interpolation of the measured cost curve (extrapolated from the last two points past
    the end)."""
    xs = sorted(costs)
    if n in costs:
        return costs[n]
    if n < xs[0]:
        return costs[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if a < n < b:
            return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
    a, b = (xs[-2], xs[-1]) if len(xs) > 1 else (xs[-1], xs[-1])
    slope = (costs[b] - costs[a]) / (b - a) if b > a else 0.0
    return costs[b] + slope * (n - b)


def tree_cost(chain: dict[int, float], flat: dict[int, float], n: int, depth: int) -> float:
    """The verify cost of n tokens in a tree `depth` levels deep, linear in depth between the flat
    tree (depth 1) and the chain (depth n - 1): on a row-exact engine each level is one more
    attention call per layer."""
    c = interpolate(chain, n)
    if n <= 2:
        return c
    # a flat tree never costs more than a chain; a noisy measure can say so
    f = min(interpolate(flat, n), c)
    return f + (c - f) * (min(max(depth, 1), n - 1) - 1) / (n - 2)


def verify_costs(
    chain: dict[int, float], flat: Optional[dict[int, float]] = None
) -> Callable[[int, int], float]:
    """cost(n, depth) from the measured curves: the chain's alone where depth does not matter (flat
    None), else `tree_cost` between the two."""
    if flat is None:
        return lambda n, depth: interpolate(chain, n)
    return lambda n, depth: tree_cost(chain, flat, n, depth)


_measured_costs: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def verify_cost_curve(
    model: Any,
    engine: Union[str, EngineOptions],
    max_tokens: int,
    saved: Optional[dict] = None,
    shape: str = "chain",
) -> dict[int, float]:
    """Seconds to verify n tokens (a chain, or a flat tree) on this machine: the chain's curve
    `headway tune` saved (verify_ms of a tuned.json entry) when it reaches max_tokens, else measured
    now (a few seconds, once per model and engine)."""
    if shape == "chain" and saved and max(int(n) for n in saved) >= max_tokens:
        return {int(n): ms / 1e3 for n, ms in saved.items()}
    cache = _measured_costs.setdefault(model, {})
    key = (
        engine_name(model, engine),
        as_options(engine),
        torch.get_num_threads(),
        max_tokens,
        shape,
    )
    if key not in cache:
        sizes = sorted({n for n in CURVE_TOKENS if n < max_tokens} | {max_tokens})
        log.info(
            "measuring the target's verification time over 1..%d tokens in a %s tree (once)",
            max_tokens,
            shape,
        )
        # a prefix of 256 tokens, or what the target's context leaves beside the largest tree
        context = int(getattr(text_config(model.config), "max_position_embeddings", None) or 4096)
        prefix = max(1, min(256, context - max_tokens - 1))
        cache[key] = verify_cost(
            model, sizes, prefix_len=prefix, repeats=5, engine=engine, shape=shape
        )
    return cache[key]
