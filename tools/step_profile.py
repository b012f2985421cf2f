"""Where a plain decoding step's time goes: the target's one-token steps under torch's profiler,
their CPU time by kind of kernel (linears, attention, the cache writes, norms and elementwise ops,
the rest) and the share outside any kernel (Python and dispatch), beside the wall time per step and
the rate it reads its weights at against the memory's; and the time of one prefill of a long prompt,
with the same breakdown.

    python tools/step_profile.py [--steps 64] [--prompt-tokens 1000] [target.dtype=bfloat16 ...]

Overrides are run config keys (target.dtype, target.linear_weights, target.num_threads,
inference.engine). Run it pinned (`taskset`), with the thread count set, on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from headway.config import load_config
from headway.inference.engines.runner import make_runner
from headway.run_config import RunConfig
from headway.target.loading import load_target
from headway.target.packed_fusion import FusedPart

# kernel names (profiler keys) by what they do; the first matching part names the kind
KINDS = (
    ("linear", ("addmm", "::mm", "linear", "matmul", "fp16", "mkldnn", "onednn", "bmm")),
    ("attention", ("attention", "flash", "sdpa", "softmax")),
    ("cache writes", ("index_copy", "index_select", "copy_")),
    (
        "norms, rope, activations",
        ("mul", "add", "rsqrt", "pow", "mean", "silu", "cat", "flip", "neg", "to", "float"),
    ),
    ("embedding, logits", ("embedding", "argmax", "topk")),
)


def kind_of(name: str) -> str:
    for kind, parts in KINDS:
        if any(p in name for p in parts):
            return kind
    return "other kernels"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear weights a one-token step reads (every projection and the lm_head; a
    stacked q/k/v or gate/up weight once, not its parts)."""
    size = torch.finfo(next(model.parameters()).dtype).bits // 8
    return sum(
        m.in_features * m.out_features * size
        for m in model.modules()
        if isinstance(getattr(m, "in_features", None), int) and not isinstance(m, FusedPart)
    )


def read_rate() -> float:
    """This machine's rate of reading memory at the thread count set, in GB/s: a float32 sum over
    300 MB (far past the caches), best of 3."""
    big = torch.ones(75_000_000)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return 300e6 / min(times) / 1e9


def report(prof: profile, calls: int, wall: float) -> None:
    """Print a profiled run's CPU time by kind of kernel and its top kernels, per call of `calls`;
    wall in seconds."""
    by_kind: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / calls
    # aten ops' self times sum to the time spent inside kernels and their dispatch; the rest of the
    # wall time is Python
    inside = sum(by_kind.values())
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:28s} {ms:7.2f} ms  {100 * ms / (wall * 1e3):5.1f}%")
    print(f"  {'outside ops (Python, profiler)':28s} {wall * 1e3 - inside:7.2f} ms")
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print("top kernels (ms per call, count per call):")
    for e in top:
        print(
            f"  {e.key[:60]:60s} {e.self_cpu_time_total / 1e3 / calls:7.3f}  {e.count / calls:6.1f}"
        )


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=64, help="one-token steps to profile (after 16 of warm-up)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=1000, help="length of the prefill timed (0: none)"
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(RunConfig, None, args.overrides)
    target = load_target(cfg.target)
    model, engine = target.model, cfg.inference.engine
    ids = torch.randint(
        1000, 20000, (max(args.prompt_tokens, 64),), generator=torch.Generator().manual_seed(0)
    )
    runner = make_runner(
        model, 32 + 16 + 2 * args.steps, engine
    )  # prompt, warm-up, timed and profiled steps
    runner.forward(ids[:32])
    token = ids[32:33]
    for _ in range(16):
        logits, _ = runner.forward(token)
        token = logits[0].argmax().view(1)
    start = time.perf_counter()  # unprofiled: the step's real wall time
    for _ in range(args.steps):
        logits, _ = runner.forward(token)
        token = logits[0].argmax().view(1)
    real = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            logits, _ = runner.forward(token)
            token = logits[0].argmax().view(1)
        wall = (time.perf_counter() - start) / args.steps
    print(
        f"{cfg.target.dtype}, linear_weights={cfg.target.linear_weights}, {cfg.target.num_threads} "
        f"thread(s), engine={engine}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"one-token step: {real * 1e3:.2f} ms wall ({1 / real:.1f} tok/s); profiled: {wall * 1e3:.2f} ms"
    )
    nbytes = weight_bytes(model)
    print(
        f"  its linear weights: {nbytes / 1e6:.0f} MB, {nbytes / real / 1e9:.1f} "
        f"GB/s over the step; this machine reads memory at {read_rate():.1f} GB/s"
    )
    report(prof, args.steps, wall)
    if args.prompt_tokens:
        times = []
        for _ in range(3):
            prefill = make_runner(model, len(ids) + 8, engine)
            start = time.perf_counter()
            prefill.forward(ids[: args.prompt_tokens])
            times.append(time.perf_counter() - start)
        print(f"prefill of {args.prompt_tokens} tokens: {min(times) * 1e3:.0f} ms (best of 3)")
        prefill = make_runner(model, len(ids) + 8, engine)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            prefill.forward(ids[: args.prompt_tokens])
            wall = time.perf_counter() - start
        print(f"prefill, profiled: {wall * 1e3:.0f} ms")
        report(prof, 1, wall)


if __name__ == "__main__":
    main()
