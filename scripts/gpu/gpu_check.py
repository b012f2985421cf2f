"""The steps of the prepared GPU check (scripts/gpu/gpu_check.sh), each appending JSON lines to one
results file.

Every figure is written as soon as it is measured, so a run killed at its time limit still leaves
what it measured. With --dry-run each step runs on the CPU with tiny budgets (CI runs it, so the
script cannot rot).

    python scripts/gpu/gpu_check.py env|cudnn|backend|exact|decode|profile|distill --results FILE [--dry-run]
        [--prompts FILE.jsonl]

- env: the GPU, torch, CUDA and transformers versions, the commit.
- cudnn: the old path's bf16 step times (static engine, HF generate); run with and without
  TORCH_CUDNN_SDPA_DEPRIORITIZED=1, it settles whether cuDNN's SDPA plans slow bf16.
- backend: the CUDA backend (inference.engine=cuda): its loop on a fake CUDA device (host reads per
  step, and inside steps), capture time and memory and replay ms per step at 1, 16,
  48 and 64 rows; host reads per speculative step of its device loop (and inside captured regions,
  under set_sync_debug_mode("error") on CUDA), its tokens against plain decoding.
- exact: greedy speculative output against plain greedy output on the same engine and dtype, per
  prompt, on tiny random models of four architectures (an untrained EAGLE-3 head) and on the default
  target (the shipped head); each (model, dtype, engine) records how many prompts were equal and
  where the first one parted.
- decode: tok/s, tau, ms per verification and per draft step of plain and speculative decoding
  (every drafter), per engine and dtype, beside Hugging Face `generate` and its prompt-lookup
  (assisted) generation, at batch 1.
- profile: one plain and one speculative decode under torch's profiler: kernels launched per target
  forward, and the time in drafting, verification and the rest (bookkeeping).
- distill: `headway distill`'s hf engine (transformers' batched generate) in generated tokens/s, per
  dtype, KV cache (dynamic, static) and batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: scripts/gpu/gpu_check.py)
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the tiny random models the test suite builds

from decode_helpers import chat_ids  # noqa: E402
from fake_cuda import fake_cuda, to_fake_cuda  # noqa: E402
from tiny_models import ARCHS, make_tiny_model  # noqa: E402

from headway.config import load_config  # noqa: E402
from headway.data_scripts.config import PromptConfig  # noqa: E402
from headway.data_scripts.engines import HFEngine, SamplingSettings  # noqa: E402
from headway.demo_config import reference_head  # noqa: E402
from headway.heads.config import Eagle3Config  # noqa: E402
from headway.heads.draft_layer import draft_layer_config  # noqa: E402
from headway.heads.eagle3 import Eagle3Head  # noqa: E402
from headway.inference.api import SpeculativeDecoder  # noqa: E402
from headway.inference.bench.baselines import hf_generate  # noqa: E402
from headway.inference.drafters.eagle import EagleDrafter  # noqa: E402
from headway.inference.engines.cuda.graphs import WARMUP, StepGraphs  # noqa: E402
from headway.inference.engines.cuda.runner import CudaRunner, cuda_supported  # noqa: E402
from headway.inference.engines.cuda.sync_guard import HostReads, Uploads  # noqa: E402
from headway.inference.engines.options import EngineOptions  # noqa: E402
from headway.inference.engines.runner import make_runner, static_supported  # noqa: E402
from headway.inference.engines.tree import build_tree  # noqa: E402
from headway.inference.generate import (  # noqa: E402
    alternate,
    plain_generate,
    pooled,
    speculative_generate,
)
from headway.kinds.registry import build_head  # noqa: E402
from headway.prompts import load_conversations  # noqa: E402
from headway.run_config import RunConfig  # noqa: E402
from headway.target.chat import ChatFormat  # noqa: E402
from headway.target.config import TargetConfig  # noqa: E402
from headway.target.loading import load_target  # noqa: E402

BUILT_IN = [
    "Explain how a hash map works, with a Python example.",
    "Write a short story about a lighthouse keeper.",
    "What is 17 times 23? Show your steps.",
    "List ten countries in Europe and their capitals.",
]
# the budgets: (prompts per set, new tokens) on the GPU and in the dry run
# (dtype, engine) pairs decoded: every pair on the GPU; in the dry run one pair per dtype, covering
# both engines
PAIRS = {
    "gpu": [
        ("bfloat16", "cuda"),
        ("bfloat16", "static"),
        ("bfloat16", "hf"),
        ("float32", "cuda"),
        ("float32", "static"),
        ("float32", "hf"),
    ],
    # (the dry run's cuda engine on the default target is the backend step's; its tree attention on
    # CPU tensors is slow)
    "dry": [("bfloat16", "static"), ("float32", "hf")],
}
# the CUDA backend's row counts timed per step (replay ms), and the cache length before them
REPLAY_ROWS = (1, 16, 48, 64)
REPLAY_PREFIX = 256
# the cache lengths replays are timed after on a GPU (tree attention's cost grows with the context:
# the GPU review's finding 4); a dry run times REPLAY_PREFIX alone
REPLAY_PREFIXES = (2048, 8192, 32768)
BUDGET = {
    "gpu": {"prompts": 14, "tokens": 128, "tiny_tokens": 48},
    "dry": {"prompts": 2, "tokens": 8, "tiny_tokens": 8},
}


class Results:
    """Appends one JSON object per line, flushed at once (a killed run keeps every line written),
    and keeps the step's deadline: a step asks `out_of_time` before each unit of work (a model, a
    prompt set) and stops there, with a row saying how far it got, rather than being killed mid-unit
    by its shell limit.

    Args:
        path: the JSON-lines file; step: the step's name; deadline: seconds this step may run (0: no
            limit)."""

    def __init__(self, path: Path, step: str, deadline: float = 0.0):
        self.path, self.step = path, step
        self.start, self.deadline = time.time(), deadline
        path.parent.mkdir(parents=True, exist_ok=True)

    def out_of_time(self, done: int, planned: int) -> bool:
        """Whether the step's deadline has passed; if so, writes how many of its `planned` units
        were `done`."""
        if not self.deadline or time.time() - self.start < self.deadline:
            return False
        self.write(
            stopped_at_deadline=True,
            deadline_s=self.deadline,
            units_done=done,
            units_planned=planned,
        )
        return True

    def write(self, **record: Any) -> None:
        line = json.dumps({"step": self.step, "time": round(time.time(), 1), **record})
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
        print(line, flush=True)


def _device(dry: bool) -> str:
    if dry:
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --dry-run on a CPU")
    return "cuda"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_env(res: Results, dry: bool) -> None:
    import transformers

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    res.write(
        dry_run=dry,
        gpu=gpu,
        gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if gpu
        else None,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        python=platform.python_version(),
        cpu=platform.processor() or platform.machine(),
        commit=commit,
    )


def _prompt_texts(path: str | None, n: int) -> list[str]:
    """The first turns of the prompt file's first prompt per category (MT-bench: 8), then the copy
    prompts shipped with Headway; without a file, built-in prompts then the copy prompts. At most
    n."""
    first: dict[str, str] = {}
    if path:
        for c in load_conversations(PromptConfig(path=path)):
            first.setdefault(str(c.meta.get("category", c.id)), c.turns[0])
    copy = load_conversations(
        PromptConfig(path=str(ROOT / "inference" / "bench" / "prompts" / "copy.jsonl"))
    )
    texts = list(first.values()) or BUILT_IN
    return (texts[: max(1, n - len(copy))] + [c.turns[0] for c in copy])[:n]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _exactness(
    model: Any, drafter: Any, prompt_ids: list[list[int]], n: int, stop: list[int], engine: str
) -> dict:
    """How many prompts speculative greedy decoding writes exactly as plain greedy decoding (same
    engine), and where each other one parts."""
    firsts = []
    for ids in prompt_ids:
        ref = plain_generate(model, ids, n, stop, engine=engine)
        spec = speculative_generate(model, drafter, ids, n, stop, engine=engine)
        firsts.append(
            None if spec.tokens == ref.tokens else _first_difference(spec.tokens, ref.tokens)
        )
    return {"prompts": len(prompt_ids), "equal": firsts.count(None), "first_difference": firsts}


def step_exact(res: Results, dry: bool, prompts: str | None) -> None:
    device, budget = _device(dry), BUDGET["dry" if dry else "gpu"]
    texts = ["What is two plus three?", "Write a short poem about the sea.", "def add(a, b):"]
    planned = len(ARCHS) * 2 + 2
    for i, (arch, dtype) in enumerate((a, d) for a in ARCHS for d in ("float32", "bfloat16")):
        if res.out_of_time(i, planned):
            return
        # (one tiny model in one dtype: a unit of the deadline)
        t, heads = _tiny_eagle(device, dtype, arch)
        drafter = EagleDrafter(heads, t.config.num_hidden_layers, 4, 3, 10)
        ids = [chat_ids(t, text) for text in texts]
        engines = ["hf"] + (["static"] if static_supported(t.model) else [])
        for engine in engines + (["cuda"] if cuda_supported(t.model) else []):
            got = _exactness(
                t.model, drafter, ids, budget["tiny_tokens"], [t.tokenizer.eos_token_id], engine
            )
            res.write(model=f"tiny-{arch}", dtype=dtype, engine=engine, device=device, **got)
    for j, dtype in enumerate(("float32", "bfloat16")):
        if res.out_of_time(len(ARCHS) * 2 + j, planned):
            return
        d = _decoder(device, dtype, dry)
        ids = [d.fmt.first_turn(text) for text in _prompt_texts(prompts, budget["prompts"])]
        for engine in ("hf", "static", "cuda"):
            got = _exactness(
                d.target.model, d.drafter, ids, budget["tokens"], d.fmt.stop_ids, engine
            )
            res.write(model="default-target", dtype=dtype, engine=engine, device=device, **got)


def _decoder(device: str, dtype: str, dry: bool, *overrides: str) -> SpeculativeDecoder:
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.device={device}",
            f"target.dtype={dtype}",
            "target.num_threads=1" if dry else "target.num_threads=0",
            "inference.use_tuned=false",
            # the dry run checks that the steps run, not their speed: the hybrid's trees are sized
            # by a fixed cost per node instead of the verification times it measures on loading (8 s
            # per decoder on 1 CPU thread)
            *(["inference.hybrid.node_cost=0.1"] if dry else []),
            *overrides,
        ],
    )
    return SpeculativeDecoder.load(reference_head(), cfg)


def _decoders(device: str, dry: bool) -> Any:
    """(dtype, engine, decoder) for each pair decoded: the target is loaded once per dtype."""
    loaded: dict[str, SpeculativeDecoder] = {}
    for dtype, engine in PAIRS["dry" if dry else "gpu"]:
        if dtype not in loaded:
            loaded = {dtype: _decoder(device, dtype, dry)}  # one target in memory at a time
        d = loaded[dtype]
        inference = dataclasses.replace(d.cfg.inference, engine=engine)
        yield (
            dtype,
            engine,
            SpeculativeDecoder(
                d.target,
                d.heads,
                dataclasses.replace(d.cfg, inference=inference),
                d.head_config,
                d.saved_costs,
            ),
        )


def step_decode(res: Results, dry: bool, prompts: str | None) -> None:
    device, budget = _device(dry), BUDGET["dry" if dry else "gpu"]
    texts, n = _prompt_texts(prompts, budget["prompts"]), budget["tokens"]
    planned = len(PAIRS["dry" if dry else "gpu"]) * len(texts)
    for p_i, (dtype, engine, decoder) in enumerate(
        _decoders(device, dry)
    ):  # (loads a target per dtype)
        if res.out_of_time(p_i * len(texts), planned):
            return
        start = time.time()
        model, stops = decoder.target.model, decoder.fmt.stop_ids
        decoder.warm_up(
            4
        )  # (the target's kernels, caches and cost curves; the timed drafters below warm too)
        runners: dict[str, Callable[[list[int]], Any]] = {
            "plain": lambda ids: decoder.generate_plain(ids, n),
            "hf_generate": lambda ids: hf_generate(
                model, ids, n, stops, decoder.cfg.inference.sampling
            ),
            "hf_prompt_lookup": lambda ids: hf_generate(
                model, ids, n, stops, decoder.cfg.inference.sampling, 10, 2
            ),
        }
        for kind in ("hybrid", "neural", "ngram"):
            d = decoder.with_drafter(kind)
            # the drafter timed is the one warmed: its expansion's capture and JIT are paid here,
            # not by the first timed prompt (a greeting's 4 tokens barely move the hybrid's
            # acceptance estimates)
            d.generate(decoder.fmt.first_turn("Hello"), 4)
            runners[kind] = lambda ids, d=d: d.generate(ids, n)
        results: dict[str, list] = {k: [] for k in runners}
        for i, text in enumerate(texts):
            if i and res.out_of_time(p_i * len(texts) + i, planned):
                break
            out = alternate(runners, decoder.fmt.first_turn(text), i)
            for k, r in out.items():
                results[k].append(r)
        plain = pooled(results["plain"])
        for k, rs in results.items():
            p, forwards = pooled(rs), max(1, sum(r.target_forwards for r in rs))
            res.write(
                device=device,
                dtype=dtype,
                engine=engine,
                method=k,
                prompts=len(texts),
                max_new_tokens=n,
                tok_s=round(p["tok_s"], 2),
                vs_plain=round(p["tok_s"] / plain["tok_s"], 3),
                tau=None if k.startswith("hf_") else round(p["tau"], 3),  # HF counts no forwards
                verify_ms=round(1e3 * sum(r.verify_seconds for r in rs) / forwards, 3),
                draft_ms=round(1e3 * sum(r.draft_seconds for r in rs) / forwards, 3),
                ms_per_plain_step=round(1e3 / plain["tok_s"], 3) if k == "plain" else None,
                equal_to_plain=sum(a.tokens == b.tokens for a, b in zip(rs, results["plain"])),
            )
        res.write(
            device=device,
            dtype=dtype,
            engine=engine,
            method="(all)",
            wall_seconds=round(time.time() - start, 1),
        )


def _kernels(prof: Any, device: str) -> int:
    """Kernels launched (CUDA) or operators run (CPU, where there are no kernels to count)."""
    events = prof.events()
    if device.startswith("cuda"):
        return sum(
            1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
    return sum(1 for e in events if e.name.startswith("aten::"))


def step_profile(res: Results, dry: bool, prompts: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    device = _device(dry)
    n = 8 if dry else 32
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for dtype, engine, decoder in _decoders(device, dry):
        ids = decoder.fmt.first_turn(BUILT_IN[0])
        decoder.warm_up(4)
        for method, run in (
            ("plain", lambda: decoder.generate_plain(ids, n)),
            ("hybrid", lambda: decoder.generate(ids, n)),
        ):
            _sync(device)
            with profile(activities=activities) as prof:
                r = run()
                _sync(device)
            forwards = max(1, r.target_forwards)
            rest = r.seconds - r.verify_seconds - r.draft_seconds
            res.write(
                device=device,
                dtype=dtype,
                engine=engine,
                method=method,
                tokens=len(r.tokens),
                target_forwards=r.target_forwards,
                kernels_per_forward=round(_kernels(prof, device) / forwards, 1),
                verify_ms_per_forward=round(1e3 * r.verify_seconds / forwards, 3),
                draft_ms_per_forward=round(1e3 * r.draft_seconds / forwards, 3),
                other_ms_per_forward=round(1e3 * rest / forwards, 3),
                top_kernels=[
                    (e.key, e.count)
                    for e in sorted(prof.key_averages(), key=lambda e: -e.count)[:8]
                ],
            )


@torch.inference_mode()  # (the engines' caches hold inference tensors)
def step_cudnn(res: Results, dry: bool, prompts: str | None) -> None:
    """The old path's bf16 steps (the static engine, SDPA at whatever backend torch prefers) and HF
    generate: ms per plain step, per 16-node verification at a new cache length each time (as
        decoding gives), and per
    HF-generated token. gpu_check.sh runs it twice, with and without
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1: if cuDNN's per-shape plans are what slows bf16, the second run
    is the faster."""
    device = _device(dry)
    dtype = "float32" if dry else "bfloat16"
    d = _decoder(device, dtype, dry, "inference.engine=static")
    model = d.target.model
    n, steps = (8, 4) if dry else (64, 24)
    ids = d.fmt.first_turn(BUILT_IN[0])
    tree = build_tree([[0] * k for k in range(1, 5)] + [[i] for i in range(1, 12)])
    d.generate_plain(ids, 4)  # warm-up
    plain = d.generate_plain(ids, n)
    runner = make_runner(model, len(ids) + steps * tree.size + 1, "static")
    runner.forward(torch.tensor(ids))
    times = []
    for i in range(steps):
        nodes = torch.randint(100, 1000, (tree.size,))
        _sync(device)
        t0 = time.perf_counter()
        runner.forward(nodes, tree)
        _sync(device)
        times.append(time.perf_counter() - t0)
        runner.keep(tree.size, [0, 1][: 1 + i % 2])  # the cache length changes every step
    _sync(device)
    t0 = time.perf_counter()
    hf = hf_generate(model, ids, n, d.fmt.stop_ids, d.cfg.inference.sampling)
    _sync(device)
    res.write(
        device=device,
        dtype=dtype,
        cudnn_sdpa_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", ""),
        plain_ms_per_step=round(1e3 * plain.seconds / max(1, len(plain.tokens)), 3),
        verify16_ms_first=round(1e3 * times[0], 3),
        verify16_ms_median=round(1e3 * statistics.median(times[1:]), 3),
        hf_generate_ms_per_token=round(
            1e3 * (time.perf_counter() - t0) / max(1, len(hf.tokens)), 3
        ),
    )


def _step_ms(runner: CudaRunner, rows: int, repeats: int, prefix: int = REPLAY_PREFIX) -> float:
    """Median ms of the CUDA backend's step at `rows` rows after a cache of `prefix` tokens as the
    device loop runs it (step, verdict read, root kept), after the warm-up that captures its
    graph."""
    ids, parent = torch.randint(100, 1000, (rows,)), torch.arange(-1, rows - 1)
    times = []
    for _ in range(WARMUP + 1 + repeats):
        _sync(str(runner.device))
        t0 = time.perf_counter()
        _, _, verdict = runner.step(ids, parent, rows)
        runner.read(verdict)
        runner.keep_path(rows, verdict[2:3])
        _sync(str(runner.device))
        times.append(time.perf_counter() - t0)
        runner.truncate(prefix)
    return 1e3 * statistics.median(times[WARMUP + 1 :])


class _NoSyncInSteps:
    """Inside every captured region (the target's bucket steps, the drafter's expansion): on CUDA
    torch.cuda.set_sync_debug_mode("error"), so a host sync there raises; everywhere, a count of
    host reads there (`reads`, which must stay 0)."""

    def __init__(self) -> None:
        self.reads, self.regions, self._run = 0, 0, StepGraphs.run

    def __enter__(self) -> "_NoSyncInSteps":
        outer = self

        def run(graphs: StepGraphs, m: int) -> Any:
            # every eager step and replay (not the call that captures: it synchronises on purpose),
            # so a step that syncs raises here: warm-ups, eager fallbacks and graphs-off runs are
            # eager steps
            capturing = (
                graphs.enabled
                and m not in graphs.graphs
                and m not in graphs.failed
                and graphs.calls.get(m, 0) >= WARMUP
            )
            cuda = not capturing and torch.cuda.is_available()
            if cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with HostReads() as reads:
                    out = outer._run(graphs, m)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            outer.reads += reads.count
            outer.regions += 1
            return out

        StepGraphs.run = run
        return self

    def __exit__(self, *exc: Any) -> None:
        StepGraphs.run = self._run


def _tiny_eagle(device: str, dtype: str, arch: str = "llama") -> tuple[Any, Any]:
    """A tiny random target of `arch` and an untrained EAGLE-3 head for it (Llama draft layer)."""
    path = make_tiny_model(arch, Path(tempfile.mkdtemp(prefix="headway-tiny-")) / arch)
    t = load_target(TargetConfig(name_or_path=str(path), device=device, dtype=dtype, num_threads=1))
    torch.manual_seed(0)
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    cfg = Eagle3Config(draft_vocab_size=min(96, V), ttt_steps=3, draft_layer="llama")
    cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
    layer = draft_layer_config(t.model.config, "llama")
    heads = build_head("eagle3", cfg, h, V, d2t=torch.arange(min(96, V)), layer_config=layer)
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    return t, heads.to(device=t.device, dtype=t.model.dtype).eval()


def _fake_cuda_loop(res: Results) -> None:
    """The CUDA backend's real loop with every tensor on a fake CUDA device
    (tests/helpers/fake_cuda.py): a device mismatch or any host read but the loop's own raises
    there; the loop's reads (`CudaRunner.read`) are counted and answered (0, 1, 2 accepted in turn),
    and the host reads and uploads inside each step counted."""
    t, heads = _tiny_eagle("cpu", "float32")
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8)
    ids = chat_ids(t, "What is two plus three?")
    no_graphs = EngineOptions(
        engine="cuda", cuda_graphs=False
    )  # fake tensors have no graphs to capture
    reads, inside, turn = [], [], iter(range(10**6))
    real_read, real_step = (
        CudaRunner.__dict__["read"],
        CudaRunner._step,
    )  # (read: the staticmethod itself)

    def read(verdict: torch.Tensor) -> list[int]:
        reads.append(1)
        if verdict.shape == (1,):
            return [1]
        m = verdict.shape[0] // 2 - 1
        return [next(turn) % 3, 1] + list(range(m)) + [1] * m

    def step(self: CudaRunner, m: int) -> Any:
        with HostReads() as host, Uploads() as up:
            out = real_step(self, m)
        inside.append((host.count, up.count))
        return out

    CudaRunner.read, CudaRunner._step = staticmethod(read), step
    try:
        with fake_cuda():
            to_fake_cuda(t.model, heads)
            r = speculative_generate(t.model, drafter, ids, 12, [], engine=no_graphs)
    finally:
        CudaRunner.read, CudaRunner._step = real_read, real_step
    steps = max(1, r.target_forwards)
    res.write(
        kind="fake_cuda",
        model="tiny-llama",
        drafter="eagle3",
        steps=r.target_forwards,
        host_reads_per_step=round((len(reads) - 1) / steps, 3),  # less the prompt's first token
        reads_inside_steps=sum(h for h, _ in inside),
        uploads_inside_steps=sum(u for _, u in inside),
    )


@torch.inference_mode()  # (the engines' caches hold inference tensors)
def step_backend(res: Results, dry: bool, prompts: str | None) -> None:
    """The CUDA backend (inference.engine=cuda): capture time and memory and replay ms per step at
    1, 16, 48 and 64 rows; then greedy EAGLE-3 decoding through its device loop with the host reads
    per speculative step counted (budget: 1) and, inside every captured region, none (on CUDA under
    set_sync_debug_mode("error")), its tokens against plain decoding on the same backend."""
    device, budget = _device(dry), BUDGET["dry" if dry else "gpu"]
    _fake_cuda_loop(res)
    for dtype in ("float32",) if dry else ("bfloat16", "float32"):
        d = _decoder(device, dtype, dry, "inference.engine=cuda", "inference.drafter=neural")
        model = d.target.model
        # (a runner of its own, one bucket per row count timed; the decoder's runner keeps its one
        # bucket)
        context = int(getattr(d.target.config, "max_position_embeddings", 0) or 2**31)
        prefixes = (
            (REPLAY_PREFIX,) if dry else tuple(p for p in REPLAY_PREFIXES if p + 128 <= context)
        )
        runner = CudaRunner(
            model, max(prefixes) + max(REPLAY_ROWS) + 1, REPLAY_ROWS, d.options.cuda_graphs
        )
        for prefix in prefixes:  # (one runner: its graphs read the cache length from memory)
            runner.truncate(0)
            runner.forward(torch.randint(100, 1000, (prefix,)))
            for rows in REPLAY_ROWS:
                with _NoSyncInSteps() as guard:
                    ms = _step_ms(runner, rows, 1 if dry else 20, prefix)
                stats = runner.graphs.stats.get(runner.bucket(rows), {})
                res.write(
                    kind="replay",
                    device=device,
                    dtype=dtype,
                    prefix=prefix,
                    rows=rows,
                    bucket=runner.bucket(rows),
                    ms_per_step=round(ms, 3),
                    graph=runner.bucket(rows) in runner.graphs.graphs,
                    capture_s=round(stats.get("capture_s", 0.0), 3),
                    pool_mib=round(stats.get("pool_bytes", 0) / 2**20, 1),
                    failed_captures=runner.graphs.failures,
                    reads_inside_steps=guard.reads,
                )
                if (
                    guard.reads
                ):  # the sync check fails the step: a step that reads the host cannot be a graph
                    raise RuntimeError(
                        f"the {rows}-row step read the host {guard.reads} times inside a step"
                    )
        texts = _prompt_texts(prompts, 1 if dry else 4)
        d.warm_up(4)
        for text in texts:
            ids = d.fmt.first_turn(text)
            plain = d.generate_plain(ids, budget["tokens"])
            with _NoSyncInSteps() as guard, HostReads() as reads:
                spec = d.generate(ids, budget["tokens"])
            steps = max(1, spec.target_forwards)
            res.write(
                kind="loop",
                device=device,
                dtype=dtype,
                drafter=d.cfg.inference.drafter,
                tree=d.drafter.settings(),
                steps=spec.target_forwards,
                host_reads=reads.count,
                host_reads_per_step=round(
                    (reads.count - 1) / steps, 3
                ),  # less the prompt's first token
                reads_inside_captured=guard.reads,
                captured_regions=guard.regions,
                tau=round(spec.tau, 3),
                tok_s=round(spec.tokens_per_second, 2),
                plain_tok_s=round(plain.tokens_per_second, 2),
                equal_to_plain=spec.tokens == plain.tokens,
            )
            if guard.reads:
                raise RuntimeError(
                    f"the device loop read the host {guard.reads} times inside its steps"
                )


# distill: (dtype, cache, batch size), most telling first (a run cut at its limit keeps those)
DISTILL = {
    "gpu": [
        ("bfloat16", "static", 256),
        ("bfloat16", "dynamic", 256),
        ("float32", "static", 256),
        ("float32", "dynamic", 256),
        ("bfloat16", "static", 1024),
    ],
    "dry": [("bfloat16", "static", 4), ("float32", "dynamic", 4)],
}


def step_distill(res: Results, dry: bool, prompts: str | None) -> None:
    device = _device(dry)
    n = 8 if dry else 128
    texts = _prompt_texts(prompts, 100)
    loaded: dict[str, Any] = {}
    for dtype, cache, batch in DISTILL["dry" if dry else "gpu"]:
        if dtype not in loaded:
            loaded = {
                dtype: load_target(
                    TargetConfig(device=device, dtype=dtype, num_threads=1 if dry else 0)
                )
            }
        t = loaded[dtype]
        fmt = ChatFormat(t.tokenizer, None, t.generation_config)
        ids = [fmt.first_turn(texts[i % len(texts)]) for i in range(batch)]
        engine = HFEngine(
            t.model, t.tokenizer.pad_token_id, fmt.stop_ids, batch_size=batch, cache=cache
        )
        engine.generate(
            ids[: min(batch, 8)], SamplingSettings(max_new_tokens=4), 0
        )  # warm-up (and compiles)
        _sync(device)
        start = time.time()
        out = engine.generate(ids, SamplingSettings(max_new_tokens=n), 0)
        _sync(device)
        seconds = time.time() - start
        tokens = sum(len(g.token_ids) for g in out)
        res.write(
            device=device,
            dtype=dtype,
            cache=cache,
            batch=batch,
            max_new_tokens=n,
            generated_tokens=tokens,
            seconds=round(seconds, 2),
            tok_s=round(tokens / seconds, 1),
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "step", choices=["env", "cudnn", "backend", "exact", "decode", "profile", "distill"]
    )
    ap.add_argument(
        "--results", required=True, help="the JSON-lines file every figure is appended to"
    )
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, with tiny budgets")
    ap.add_argument(
        "--prompts",
        default=None,
        help="prompt file (MT-bench questions); default: built-in prompts",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds the step may run: it stops between units of work, writing how far it got (0: none)",
    )
    args = ap.parse_args()
    res = Results(Path(args.results), args.step, args.deadline)
    if args.step == "env":
        step_env(res, args.dry_run)
    else:
        steps = {
            "cudnn": step_cudnn,
            "backend": step_backend,
            "exact": step_exact,
            "decode": step_decode,
            "profile": step_profile,
            "distill": step_distill,
        }
        steps[args.step](res, args.dry_run, args.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
