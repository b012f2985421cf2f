"""The CUDA backend's step is capturable and its loop reads the host once a step, proven on a CPU:
- fake CUDA (tests/helpers/fake_cuda.py): the real runner, drafters and loop with every tensor on
  "cuda"; a device mismatch or a stray host read raises there; the loop's one read per step
  (`CudaRunner.read`) is counted and answered, and nothing inside a step reads the host or uploads;
- a checking torch.compile backend (tests/helpers/capture_check.py, fullgraph=True, dynamic=False):
  each bucket's step compiles to one graph free of host syncs and data-dependent sizes, mutating
  only the KV cache, and a sweep of positions and trees in a bucket recompiles nothing
  (`fail_on_recompile`);
- frozen scalars: two steps of a bucket at different positions and trees record the same op trace.
"""

from __future__ import annotations

import random

import pytest
import torch

from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.drafters import eagle as draft_eagle
from headway.inference.drafters import eagle_device as draft_eagle_device
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.cuda.runner import CudaRunner
from headway.inference.engines.cuda.sync_guard import HostReads, Uploads
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.tree import build_tree
from headway.inference.generate import speculative_generate
from tests.helpers.capture_check import CaptureRefused, CheckingBackend, OpTrace
from tests.helpers.decode_helpers import chat_ids, load64
from tests.helpers.fake_cuda import fake_cuda, to_fake_cuda
from tests.inference.test_speculative_exact import WIDE_TREE
from tests.kinds.test_eagle import random_head


def load32(path):
    t = load64(path)
    t.model.float()
    return t


def head(t, kind):
    if kind == "eagle3":
        return random_head(t, "eagle3").float()
    cfg = MedusaConfig(num_heads=4, lm_head="shared")
    heads = MedusaHeads(cfg, t.config.hidden_size, t.config.vocab_size)
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    return heads.float()


def drafter_of(t, kind, heads):
    """The drafter, made outside the fake mode (a static tree is host bookkeeping, whose reads would
    raise there)."""
    if kind == "eagle3":
        return EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8)
    return MedusaDrafter(heads, build_tree(WIDE_TREE), t.config.num_hidden_layers)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_fake_cuda_loop_reads_the_host_once_a_step(tiny_dirs, kind, monkeypatch):
    t = load32(tiny_dirs["llama"])
    heads = head(t, kind)
    drafter = drafter_of(t, kind, heads)
    ids = chat_ids(t, "What is two plus three?")
    # a CPU build has no CUDA graphs; the steps they would capture run
    no_graphs = EngineOptions(engine="cuda", cuda_graphs=False)
    reads, step_traffic = [], []
    verdicts = iter(range(1000))

    def read(verdict):
        # the loop's one read: answer with an accepted count that varies (0, 1, 2), bonus token 1
        reads.append(tuple(verdict.shape))
        if verdict.shape == (1,):
            return [1]
        m = verdict.shape[0] // 2 - 1
        a = next(verdicts) % 3
        return [a, 1] + list(range(m)) + [1] * m

    monkeypatch.setattr(CudaRunner, "read", staticmethod(read))
    real_step = CudaRunner._step

    def counted_step(self, m):
        with HostReads() as host, Uploads() as up:
            out = real_step(self, m)
        step_traffic.append((host.count, up.count))
        return out

    monkeypatch.setattr(CudaRunner, "_step", counted_step)
    with fake_cuda():
        to_fake_cuda(t.model, heads)
        res = speculative_generate(t.model, drafter, ids, 12, [], engine=no_graphs)
    steps = res.target_forwards
    assert steps >= 4 and res.accepted[:3] == [0, 1, 2]
    assert len(reads) == steps + 1  # one per step, and the prompt's first token
    assert len(step_traffic) == steps and set(step_traffic) == {(0, 0)}


def _sweep(runner, drafter_trees, steps=8, seed=0):
    """Steps of one bucket at growing positions with varied trees: (ids, parent, n) per step."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        tree = drafter_trees[i % len(drafter_trees)]
        ids = torch.tensor([rng.randrange(50) for _ in range(tree.size)])
        out.append((ids, torch.tensor(tree.parent), tree.size, rng.randrange(len(tree.parent))))
    return out


TREES = [
    build_tree(WIDE_TREE),
    build_tree([[0], [0, 0], [0, 0, 0]]),
    build_tree([[0], [1], [2], [3]]),
    build_tree([[0]]),
    build_tree(
        [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
    ),
]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_each_bucket_compiles_to_one_checked_graph_with_no_recompile(tiny_dirs, arch):
    t = load32(tiny_dirs[arch])
    runner = CudaRunner(t.model, 96, buckets=(1, 12))
    runner.forward(torch.arange(5, 25))
    backend = CheckingBackend()
    real = runner._step
    runner.graphs.step = torch.compile(real, backend=backend, fullgraph=True, dynamic=False)
    eager = CudaRunner(t.model, 96, buckets=(1, 12), graphs=False)
    eager.forward(torch.arange(5, 25))
    for n, (ids, parent, size, keep_to) in enumerate(_sweep(runner, TREES)):
        if n == 1:  # the first step compiled bucket 12's graph: no other may be compiled now
            torch.compiler.set_stance("fail_on_recompile")
        a = runner.step(ids, parent, size)
        b = eager.step(ids, parent, size)
        assert torch.equal(a[0][:size], b[0][:size]) and torch.equal(a[2], b[2])
        path = torch.tensor(
            [0, 1][: 1 + (keep_to % 2 if size > 1 else 0)]
        )  # node 1 is a child of the root
        runner.keep_path(size, path)
        eager.keep_path(size, path)
    torch.compiler.set_stance("default")
    assert backend.graphs == 1
    assert backend.mutated and all(".cache." in name for name in backend.mutated), backend.mutated
    # the one-row bucket (plain decoding) is a graph of its own
    runner.step(torch.tensor([3]), torch.tensor([-1]), 1)
    assert backend.graphs == 2


def test_the_checking_backend_refuses_host_syncs():
    """What `fullgraph=True` alone compiles, the checker refuses."""

    def item(x):
        return x * x.sum().item()

    def nonzero(x):
        return x.nonzero()

    def mask(x):
        return x[x > 0]

    for fn in (item, nonzero, mask):
        torch._dynamo.reset()
        with pytest.raises(Exception) as err:
            torch.compile(fn, backend=CheckingBackend(), fullgraph=True, dynamic=False)(
                torch.randn(8)
            )
        assert isinstance(err.value, CaptureRefused) or "CaptureRefused" in repr(err.value), fn


def test_steps_of_a_bucket_record_the_same_ops(tiny_dirs):
    """No per-step Python number is frozen into a step: at other positions and with other trees, a
    bucket's step runs the same ops on the same shapes with the same constants."""
    t = load32(tiny_dirs["mistral"])
    runner = CudaRunner(t.model, 96, buckets=(1, 12), graphs=False)
    runner.trim_blocks = (
        False  # (the CPU emulation's one host number; a graphable step runs every block)
    )
    runner.forward(torch.arange(5, 25))
    traces = []
    real = runner.graphs.step

    def traced(m):
        with OpTrace() as trace:
            out = real(m)
        traces.append(trace.ops)
        return out

    runner.graphs.step = traced
    for ids, parent, size, _ in _sweep(runner, TREES[:3], steps=3):
        runner.step(ids, parent, size)
        runner.keep_path(size, torch.tensor([0]))
    assert len(traces) == 3 and traces[0] == traces[1] == traces[2]
    assert runner.length == 23


def torch_top_logprobs(logits, k):
    """row_select.top_logprobs as it runs off the CPU (no C++ kernel)."""
    top = torch.log_softmax(logits.float(), -1).topk(k)
    return top.values, top.indices


def test_the_eagle_expansion_compiles_to_one_checked_graph(tiny_dirs, monkeypatch):
    """The drafter's expansion (its own graph on CUDA): one graph over steps at growing committed
    lengths, free of host syncs, writing only the drafter's cache, and the host drafter's tree at
    every step."""
    for module in (draft_eagle, draft_eagle_device):  # the CPU's C++ top-k kernel is not traceable
        monkeypatch.setattr(module, "top_logprobs", torch_top_logprobs)
    t = load32(tiny_dirs["llama"])
    heads = head(t, "eagle3")
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8)
    drafter.reserve(96)
    ids = chat_ids(t, "Write a short poem about the sea.")
    runner = CudaRunner(t.model, 96, graphs=False)
    _, hidden = runner.forward(torch.tensor(ids), hidden=True)
    feats = torch.cat([hidden[i][0] for i in drafter.feature_layers], -1)
    drafter.begin(ids, 7, feats)
    drafter.draft_tensors(torch.tensor([5]))  # makes the expansion
    backend = CheckingBackend()
    expansion = drafter.expansion
    expansion.graphs.step = torch.compile(
        lambda _: expansion._expand(), backend=backend, fullgraph=True
    )
    try:
        for step in range(4):
            if step == 1:
                torch.compiler.set_stance("fail_on_recompile")
            nodes, tree = drafter.draft(5 + step)
            d_nodes, d_parent = drafter.draft_tensors(torch.tensor([5 + step]))
            assert d_nodes.tolist() == nodes.tolist() and d_parent.tolist() == tree.parent
            drafter.accept([3 + step, 4, 6][: 1 + step % 3], feats[step : step + 1 + step % 3])
    finally:
        torch.compiler.set_stance("default")
    assert backend.graphs == 1
    assert backend.mutated and all(".cache." in name for name in backend.mutated), backend.mutated
