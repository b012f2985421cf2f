"""The CUDA path's findings of the GPU review (docs/gpu-review-inference.md), each proven on a CPU:
mocked CUDA streams and graphs (a recorder of which device each stream, capture and step ran on),
weak references (what a runner keeps alive), a dispatch-mode counter (fp32 copies), an SDPA recorder
(which calls would fall to the math kernel), and the Triton kernel in its interpreter."""

from __future__ import annotations

import ast
import contextlib
import gc
import inspect
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from headway.inference.engines.batch import BatchDecoder
from headway.inference.engines.cuda import graphs as engine_graphs
from headway.inference.engines.cuda import tree_attention as kernel_tree_attention
from headway.inference.engines.cuda.graphs import StepGraphs
from headway.inference.engines.cuda.runner import CudaRunner, cuda_supported
from headway.inference.engines.layer_step import gqa_sdpa
from headway.inference.sampling import SamplingConfig
from tests.helpers import ROOT_DIR
from tests.helpers.decode_helpers import load64
from tests.helpers.fake_cuda import fake_cuda, to_fake_cuda

ROOT = ROOT_DIR


class MockCuda:
    """torch.cuda's streams, graphs and device context as recorders: `current` is the current device
    index; each stream remembers its device; each capture records the device current at entry and
    its stream's."""

    class Stream:
        def __init__(self, device=None):
            self.device = (
                torch.device(device) if device is not None else torch.device("cuda", MockCuda.now)
            )

        def wait_stream(self, other):
            pass

    now = 0

    def __init__(self, monkeypatch, fail_capture: bool = False):
        MockCuda.now = 0
        self.streams, self.captures, self.steps, self.set_streams = [], [], [], []
        self.reserved = iter([100, 400, 500, 900])
        self.current = MockCuda.Stream(torch.device("cuda", 0))
        cuda = self

        @contextlib.contextmanager
        def device(d):
            was, MockCuda.now = MockCuda.now, torch.device(d).index
            try:
                yield
            finally:
                MockCuda.now = was

        def stream_factory(device=None):
            s = MockCuda.Stream(device)
            cuda.streams.append(s.device.index)
            return s

        @contextlib.contextmanager
        def stream(s):
            was, cuda.current = cuda.current, s
            try:
                yield
            finally:
                cuda.current = was

        class Graph:
            def replay(self):
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            s = stream if stream is not None else stream_factory()
            cuda.captures.append((MockCuda.now, s.device.index, gc.isenabled()))
            was, cuda.current = cuda.current, s
            yield
            if fail_capture:  # capture_end raises before the stream context exits (torch's order)
                raise RuntimeError("operation not permitted when stream is capturing")
            cuda.current = was

        def set_stream(s):
            cuda.set_streams.append(s)
            cuda.current = s

        for name, value in {
            "Stream": stream_factory,
            "stream": stream,
            "graph": graph,
            "CUDAGraph": Graph,
            "device": device,
            "synchronize": lambda device=None: None,
            "graph_pool_handle": lambda: object(),
            "memory_reserved": lambda device=None: next(cuda.reserved),
            "empty_cache": lambda: None,
            "current_stream": lambda device=None: cuda.current,
            "set_stream": set_stream,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def step(self, m):
        self.steps.append((MockCuda.now, self.current.device.index, gc.isenabled()))
        return m


def test_streams_captures_and_replays_run_on_the_runners_device(monkeypatch):
    """Finding 1: device 1's warm-up, capture and replay run on device 1 while device 0 is
    current."""
    cuda = MockCuda(monkeypatch)
    graphs = StepGraphs(cuda.step, torch.device("cuda", 1))
    for _ in range(engine_graphs.WARMUP + 2):
        graphs.run(16)
    assert cuda.streams and set(cuda.streams) == {1}
    assert [(now, stream) for now, stream, _ in cuda.captures] == [(1, 1)]
    assert all(now == 1 and stream == 1 for now, stream, _ in cuda.steps)
    assert 16 in graphs.graphs and MockCuda.now == 0


def test_the_tree_kernel_launches_under_its_tensors_device():
    """Finding 1: Triton launches on the current device; `kernel` enters
    `torch.cuda.device(q.device)`."""
    tree = ast.parse(inspect.getsource(kernel_tree_attention.kernel))
    pinned = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and "torch.cuda.device(q.device)" in ast.unparse(node.items[0].context_expr)
        and any(
            isinstance(c, ast.Call) and ast.unparse(c.func) == "_launch" for c in ast.walk(node)
        )
    ]
    assert pinned
    launches = [
        n
        for n in ast.walk(ast.parse(inspect.getsource(kernel_tree_attention)))
        if "_kernel[" in ast.unparse(n)
    ]
    assert launches  # (the launch itself lives in `_launch`, called only from the pinned block)


def test_a_capture_runs_with_the_collector_off_and_restores_it(monkeypatch):
    """Finding 3: a collection inside a capture that frees an older graph invalidates it (torch >=
    2.9 no longer collects first): the capture collects, then runs with the collector off."""
    cuda = MockCuda(monkeypatch)
    graphs = StepGraphs(cuda.step, torch.device("cuda", 0))
    for _ in range(engine_graphs.WARMUP + 1):
        graphs.run(4)
    assert [enabled for *_, enabled in cuda.captures] == [False]
    assert [enabled for *_, enabled in cuda.steps] == [True, True, False]
    assert gc.isenabled()


def test_a_failed_capture_restores_the_stream_and_is_counted(monkeypatch):
    """Finding 7: capture_end raising leaves the capture stream current unless the runner restores
    it; the failure is counted in `failures` and `stats`, and pool sizes are measured after the
    cache is emptied."""
    cuda = MockCuda(monkeypatch, fail_capture=True)
    before = cuda.current
    graphs = StepGraphs(cuda.step, torch.device("cuda", 0))
    for _ in range(engine_graphs.WARMUP + 2):
        assert graphs.run(8) == 8  # (the eager fallback)
    assert cuda.current is before and cuda.set_streams == [before]
    assert graphs.failures == 1 and "failed" in graphs.stats[8] and 8 in graphs.failed
    ok = StepGraphs(MockCuda(monkeypatch).step, torch.device("cuda", 0))
    for _ in range(engine_graphs.WARMUP + 1):
        ok.run(8)
    assert ok.stats[8]["pool_bytes"] >= 0


@torch.inference_mode()
def test_runners_and_expansions_die_with_their_last_reference(tiny_dirs):
    """Finding 3: no reference cycle keeps a runner (its cache and graphs) alive past its last
    reference; `CudaRunner.of` frees the old runner when it grows, and the model holds no attribute
    for it."""
    t = load64(tiny_dirs["llama"])
    was = gc.isenabled()
    gc.disable()
    try:
        r = CudaRunner(t.model, 32, graphs=False)
        w = weakref.ref(r)
        del r
        assert w() is None
        old = CudaRunner.of(t.model, 16)
        w_old = weakref.ref(old)
        del old
        new = CudaRunner.of(t.model, 64)
        assert w_old() is None and new.max_len >= 64
        assert not [a for a in vars(t.model) if "headway" in a]
        w_new = weakref.ref(new)
        del new
        assert w_new() is not None  # (kept for the model's next sequence)
        model = weakref.ref(t.model)
        t.model = None
        del t
        assert model() is None and w_new() is None
    finally:
        if was:
            gc.enable()


@torch.inference_mode()
def test_an_eagle_expansion_dies_with_its_drafter(tiny_dirs):
    """Finding 3: the drafter and its device expansion form no cycle (a weak proxy and a weak
    method)."""
    from headway.inference.drafters.eagle import EagleDrafter
    from headway.inference.drafters.eagle_device import EagleExpansion
    from tests.kinds.test_eagle import random_head

    t = load64(tiny_dirs["llama"])
    drafter = EagleDrafter(random_head(t, "eagle3"), t.config.num_hidden_layers, 2, 2, 4)
    ids = list(range(5, 15))
    hidden = torch.zeros(len(ids), t.config.hidden_size * 3, dtype=torch.float64)
    drafter.begin(ids, 3, hidden)
    was = gc.isenabled()
    gc.disable()
    try:
        drafter.expansion = EagleExpansion(drafter, 64, graphs=False)
        w = weakref.ref(drafter.expansion)
        del drafter
        assert w() is None
    finally:
        if was:
            gc.enable()


class Float32Copies(TorchDispatchMode):
    """Counts the float32 `_to_copy` results of `numel` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and out.dtype == torch.float32
            and out.numel() == self.numel
        ):
            self.count += 1
        return out


@torch.inference_mode()
def test_the_batched_distill_step_copies_no_span_to_float32(tiny_dirs, monkeypatch):
    """Finding 5: a bf16 decode step attends over the cache in its own dtype (no fp32 copy of the
    span's K/V per layer), and the prompt's SDPA runs with cuDNN's kernel off."""
    t = load64(tiny_dirs["llama"])
    t.model.to(torch.bfloat16)
    dec = BatchDecoder(t.model, batch=2, max_len=48, stop_ids=[], graphs=False)
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    dec._prefill(0, list(range(5, 17)), 8)
    dec._prefill(1, list(range(7, 20)), 8)
    assert seen and not any(seen)
    end = 16
    kv, hd = dec.net.kv_heads, dec.net.head_dim
    with Float32Copies(2 * kv * end * hd) as copies:
        dec._step(end)
    assert copies.count == 0


def _recording_sdpa(monkeypatch) -> list:
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **kw):
        calls.append((attn_mask is not None, q.shape[-3], k.shape[-3]))
        return real(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            **kw,
        )

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def test_masked_grouped_query_sdpa_folds_the_group_and_keeps_the_result(monkeypatch):
    """Finding 6: with a mask and grouped heads, the call SDPA gets has matching head counts (the
    memory- efficient kernel takes it; no math fallback), and the result is the grouped
    attention's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    for mask in (torch.rand(5, 9, generator=g) > 0.3, torch.rand(1, 1, 5, 9, generator=g) > 0.3):
        mask[:, ..., 0] = True
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        calls = _recording_sdpa(monkeypatch)
        got = gqa_sdpa(q, k, v, mask, False, 0.3, fold=True)
        monkeypatch.undo()
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
        assert all(not masked or hq == hk for masked, hq, hk in calls), calls


@torch.inference_mode()
def test_on_cuda_no_masked_call_reaches_sdpa_with_grouped_heads(tiny_dirs, monkeypatch):
    """Finding 6 on fake CUDA: Gemma-3's prompt past its window (a sliding mask) and the masked
    steps call SDPA with one head count on both sides."""
    t = load64(tiny_dirs["gemma3"])
    t.model.float()
    calls = _recording_sdpa(monkeypatch)
    with fake_cuda():
        to_fake_cuda(t.model)
        runner = CudaRunner(t.model, 200, buckets=(4,), graphs=False, attention="masked")
        runner.forward(torch.arange(3, 140))
        runner.forward(torch.tensor([5]))
    masked = [c for c in calls if c[0]]
    assert masked and all(hq == hk for _, hq, hk in masked), calls


@torch.inference_mode()
def test_a_prompt_without_hidden_states_keeps_no_layer_output(tiny_dirs, monkeypatch):
    """Finding 8: plain decoding's prompt holds one layer's output at a time, not every layer's."""
    t = load64(tiny_dirs["llama"])
    runner = CudaRunner(t.model, 64, graphs=False)
    outs, alive = [], []
    real = runner.net.layer

    def layer(i, *args, **kwargs):
        alive.append(sum(w() is not None for w in outs))
        x = real(i, *args, **kwargs)
        outs.append(weakref.ref(x))
        return x

    monkeypatch.setattr(runner.net, "layer", layer)
    runner.forward(torch.arange(5, 30))
    assert len(outs) == t.config.num_hidden_layers and max(alive) <= 1


@torch.inference_mode()
def test_the_cuda_runner_leaves_the_process_cudnn_switch_alone(tiny_dirs):
    """Finding 9: cuDNN's SDPA is off inside the runner's steps (pinned_sdpa), never
    process-wide."""
    t = load64(tiny_dirs["llama"])
    t.model.float()
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # (as on a GPU build)
    try:
        with fake_cuda():
            to_fake_cuda(t.model)
            CudaRunner(t.model, 32, graphs=False)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@torch.inference_mode()
def test_a_new_sampling_setting_keeps_the_runners_graphs(tiny_dirs):
    """Finding 10: a change of sampling settings resets the graphs in place (the old ones freed
    now)."""
    t = load64(tiny_dirs["llama"])
    runner = CudaRunner(t.model, 32, graphs=False)
    graphs = runner.graphs
    runner.set_sampling(SamplingConfig(temperature=1.0))
    runner.set_sampling(SamplingConfig(temperature=0.7))
    assert runner.graphs is graphs and runner.sampling.temperature == 0.7


def test_longrope_targets_are_not_run_by_the_cuda_backend(tiny_dirs):
    """Finding 11a: longrope's factors switch with the sequence's length: its tables are not by
    position."""
    t = load64(tiny_dirs["llama"])
    assert cuda_supported(t.model)
    t.model.model.rotary_emb.rope_type = "longrope"
    assert not cuda_supported(t.model)


@pytest.mark.skipif(kernel_tree_attention.triton is None, reason="triton is not installed")
def test_the_kernel_runs_multi_head_attention_without_groups():
    """Finding 11b: kv_heads == heads (GROUP_P = 1) in the interpreter equals the reference."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 64, 16, generator=g)
    v = torch.randn(4, 64, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    tails = torch.tensor([[30, 0], [30, 31], [32, 0]])
    lens = torch.tensor([1, 2, 1])
    a = kernel_tree_attention.kernel(q, k, v, torch.tensor(30), tails, lens, 0.25)
    b = kernel_tree_attention.reference(q, k, v, torch.tensor(30), tails, lens, 0.25)
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
