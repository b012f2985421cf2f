"""The row-exact tree attention (inference/engines/cuda/tree_attention.py): the torch reference on
CPU tensors, and the Triton kernel under the interpreter (TRITON_INTERPRET=1, skipped without
triton). A row's bits are the same alone or among 64 rows, and a tree row's (its ancestors at
scattered slots) equal the plain row's with the same virtual sequence (its ancestors compacted into
the prefix), at starts 0, 1, BLOCK_N - 1 and more, depths 1 to the maximum; both are within bf16
rounding of a float64 attention."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from headway.inference.engines.cuda import tree_attention as kta
from tests.helpers import ROOT_DIR

ROOT = ROOT_DIR
KV, GROUP, HD, CAP, DEPTH = 2, 3, 32, 96, 6


# where the kernels run: the GPU when there is one (scripts/gpu/gpu_check.sh reruns these tests
# there), else CPU tensors (the Triton kernel in its interpreter; tests/conftest.py sets
# TRITON_INTERPRET=1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(fn):
    """fn with its tensor arguments on DEVICE and its result back on the CPU."""

    def run(*args, **kwargs):
        moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        return fn(*moved, **kwargs).cpu()

    return run


def implementations() -> list:
    impls = [pytest.param(on_device(kta.reference), id="reference")]
    if kta.triton is not None:
        impls.append(pytest.param(on_device(kta.kernel), id="triton"))
    return impls


def caches(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KV, CAP, HD, generator=g).to(dtype)
    v = torch.randn(KV, CAP, HD, generator=g).to(dtype)
    return k, v


def queries(n, dtype=torch.bfloat16, seed=1):
    return torch.randn(n, KV * GROUP, HD, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dense(q, k, v, start, tails, lens, scale, window=None):
    """float64 attention of each row over its gathered virtual sequence (its last `window`
    positions)."""
    out = []
    for i in range(q.shape[0]):
        slots = list(range(start)) + tails[i, : lens[i]].tolist()
        slots = slots[-window:] if window else slots
        kk = k[:, slots].double().repeat_interleave(GROUP, 0)
        vv = v[:, slots].double().repeat_interleave(GROUP, 0)
        w = torch.softmax((q[i].double()[:, None, :] * kk).sum(-1) * scale, -1)
        out.append((w[..., None] * vv).sum(1).reshape(-1))
    return torch.stack(out)


def random_rows(n, start, rng):
    tails = torch.zeros(n, DEPTH, dtype=torch.long)
    lens = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        d = int(rng.integers(1, DEPTH + 1))
        slots = sorted(rng.choice(range(start, CAP), size=d, replace=False).tolist())
        tails[i, :d] = torch.tensor(slots)
        lens[i] = d
    return tails, lens


@pytest.mark.parametrize("impl", implementations())
def test_a_row_alone_equals_the_row_among_64(impl):
    import numpy as np

    rng = np.random.default_rng(0)
    k, v = caches()
    start = torch.tensor(21)
    q = queries(64)
    tails, lens = random_rows(64, 21, rng)
    together = impl(q, k, v, start, tails, lens, HD**-0.5)
    for i in (0, 1, 17, 63):
        alone = impl(q[i : i + 1], k, v, start, tails[i : i + 1], lens[i : i + 1], HD**-0.5)
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("start", [0, 1, kta.BLOCK_N - 1, kta.BLOCK_N, 37])
@pytest.mark.parametrize("window", [None, 20])
def test_a_tree_row_equals_the_plain_row_of_its_virtual_sequence(impl, start, window):
    """The tree row's ancestors sit at scattered slots; the plain row has them compacted after the
    prefix (the cache after the path is kept) and is itself the one-token step that follows."""
    import numpy as np

    rng = np.random.default_rng(start)
    k, v = caches(seed=start)
    for depth in range(1, DEPTH + 1):
        slots = sorted(rng.choice(range(start, CAP - DEPTH), size=depth, replace=False).tolist())
        q = queries(1, seed=depth)
        tree = impl(
            q,
            k,
            v,
            torch.tensor(start),
            torch.tensor([slots + [0] * (DEPTH - depth)]),
            torch.tensor([depth]),
            HD**-0.5,
            window=window,
        )
        kc, vc = k.clone(), v.clone()
        kc[:, start : start + depth], vc[:, start : start + depth] = k[:, slots], v[:, slots]
        me = start + depth - 1
        one = torch.tensor([[me] + [0] * (DEPTH - 1)])
        plain = impl(q, kc, vc, torch.tensor(me), one, torch.tensor([1]), HD**-0.5, window=window)
        assert torch.equal(tree, plain), (start, depth)


@pytest.mark.parametrize("window", [None, 20])
def test_the_reference_stopped_at_the_longest_row_gives_the_same_bits(window):
    """The CPU emulation runs only the blocks up to the longest row's last key (a host number):
    every block past a row's length leaves it unchanged, so the bits are those of the pass over the
    whole cache."""
    import numpy as np

    k, v = caches()
    q = queries(16)
    tails, lens = random_rows(16, 33, np.random.default_rng(9))
    tails = tails.clamp(max=40)  # (every row ends by slot 40: block 2 of 6)
    whole = kta.reference(q, k, v, torch.tensor(33), tails, lens, HD**-0.5, window=window)
    reach = -(-(33 + DEPTH) // kta.BLOCK_N)
    trimmed = kta.reference(
        q, k, v, torch.tensor(33), tails, lens, HD**-0.5, blocks=reach, window=window
    )
    assert reach < -(-CAP // kta.BLOCK_N) and torch.equal(whole, trimmed)


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
def test_it_is_attention_within_the_storage_rounding(impl, dtype, window):
    import numpy as np

    k, v = caches(dtype)
    q = queries(9, dtype)
    tails, lens = random_rows(9, 30, np.random.default_rng(3))
    got = impl(q, k, v, torch.tensor(30), tails, lens, HD**-0.5, window=window).double()
    want = dense(q, k, v, 30, tails, lens, HD**-0.5, window)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the output's rounding to bf16; float32's own
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.skipif(kta.triton is None, reason="triton is not installed")
def test_the_kernel_and_the_reference_agree():
    import numpy as np

    k, v = caches(torch.float32)
    q = queries(12, torch.float32)
    tails, lens = random_rows(12, 40, np.random.default_rng(5))
    a = on_device(kta.kernel)(q, k, v, torch.tensor(40), tails, lens, 0.2)
    b = on_device(kta.reference)(q, k, v, torch.tensor(40), tails, lens, 0.2)
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_the_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from headway.inference.engines.cuda import tree_attention as k\n"
        "assert k.triton is None and not k.triton_available()\n"
        "import torch\n"
        "out = k.tree_attention(torch.randn(2, 4, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8),"
        " torch.tensor(3), torch.tensor([[3, 0], [4, 5]]), torch.tensor([1, 2]), 0.3)\n"
        "assert out.shape == (2, 32)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# -- the kernel's work follows the real rows (issue 75, review finding 4) -----------------------------------
# small shapes for the interpreter: blocks of 4 keys, splits of 2 blocks, tiles of 4 rows


def small_dense(q, k, v, slots_of_row, scale, window=None):
    """float64 attention of one query row [heads, hd] over the given cache slots (grouped heads)."""
    slots = slots_of_row[-window:] if window else slots_of_row
    group = q.shape[0] // k.shape[0]
    kk = k[:, slots].double().repeat_interleave(group, 0)
    vv = v[:, slots].double().repeat_interleave(group, 0)
    w = torch.softmax((q.double()[:, None, :] * kk).sum(-1) * scale, -1)
    return (w[..., None] * vv).sum(1).reshape(-1)


needs_triton = pytest.mark.skipif(kta.triton is None, reason="triton is not installed")
SMALL = dict(block_n=4, split_n=8, tile_rows=4)


@needs_triton
@pytest.mark.parametrize(
    "dtype, window", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, 7)], ids=str
)
def test_a_tree_row_equals_its_one_row_plain_step_at_every_length(dtype, window):
    """A 5-row tree in an 8-row bucket (3 pad rows, two tiles), at contexts of 0, 9 and 40 keys (1
    to 6 splits of 8 keys): rows 0, 2 and 4 give, bit for bit, what the kernel gives each as the one
    real row of a plain step (its ancestors compacted after the prefix, 7 pad rows of other data
    beside it); pad rows give zeros; every real row is attention within its storage's rounding."""
    import numpy as np

    kv, group, hd, depth, bucket, real = 2, 2, 8, 4, 8, 5
    scale = hd**-0.5
    run = on_device(kta.kernel)
    for start in (0, 9, 40):
        cap = start + 2 * depth + 1
        rng = np.random.default_rng(start)
        g = torch.Generator().manual_seed(start)
        k = torch.randn(kv, cap, hd, generator=g).to(dtype)
        v = torch.randn(kv, cap, hd, generator=g).to(dtype)
        q = torch.randn(bucket, kv * group, hd, generator=g).to(dtype)
        tails = torch.full((bucket, depth), cap - 1, dtype=torch.long)
        lens = torch.ones(bucket, dtype=torch.long)
        for i in range(real):
            d = int(rng.integers(1, depth + 1))
            tails[i, :d] = torch.tensor(
                sorted(rng.choice(range(start, cap - 1), size=d, replace=False))
            )
            lens[i] = d
        rows = torch.tensor(real)
        tree = run(q, k, v, torch.tensor(start), tails, lens, scale, window, rows, **SMALL)
        assert torch.equal(tree[real:], torch.zeros_like(tree[real:]))
        for i in range(real):
            d = int(lens[i])
            want = small_dense(
                q[i], k, v, list(range(start)) + tails[i, :d].tolist(), scale, window
            )
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(tree[i].double(), want, atol=tol, rtol=tol), (start, i)
            if i % 2:
                continue
            kc, vc = k.clone(), v.clone()
            kc[:, start : start + d], vc[:, start : start + d] = (
                k[:, tails[i, :d]],
                v[:, tails[i, :d]],
            )
            me = start + d - 1
            pq = torch.randn(bucket, kv * group, hd, generator=g).to(dtype)
            pq[0] = q[i]
            ptails = torch.randint(0, cap, (bucket, depth), generator=g)
            ptails[0, 0] = me
            plens = torch.ones(bucket, dtype=torch.long)
            one = run(
                pq, kc, vc, torch.tensor(me), ptails, plens, scale, window, torch.tensor(1), **SMALL
            )
            assert torch.equal(tree[i], one[0]), (start, i)


def blocks_read(n_real, bucket, start, window=None, kv=2, group=2, hd=8, depth=6, **shape):
    """The key blocks the kernel reads (its counter) for `n_real` rows of a `bucket`-row step at
    `start` keys of context (row i at depth i % depth + 1), and the output."""
    g = torch.Generator().manual_seed(start)
    cap = start + depth + 1
    k, v = torch.randn(kv, cap, hd, generator=g), torch.randn(kv, cap, hd, generator=g)
    q = torch.randn(bucket, kv * group, hd, generator=g)
    lens = torch.tensor([i % depth + 1 for i in range(bucket)])
    tails = start + torch.arange(depth).expand(bucket, depth).contiguous()
    counter = torch.zeros(1, dtype=torch.long)
    out = on_device(kta.kernel)(
        q,
        k,
        v,
        torch.tensor(start),
        tails,
        lens,
        0.3,
        window,
        torch.tensor(n_real),
        counter=counter,
        **shape,
    )
    return int(counter.cpu()), out


@needs_triton
def test_a_plain_step_in_the_64_row_bucket_reads_its_one_row_s_blocks():
    """The measure: a plain step (1 real row) at 1,000 keys of context in the 64-row bucket read
    64 rows x 63 blocks per key-value head before (every pad row scanned the prefix); now 63, its
    row's own, the 63 pad rows read nothing and give zeros. Split every 256 keys, it reads the same
    63 blocks."""
    kv, per_row = 2, -(-1001 // kta.BLOCK_N)
    assert per_row == 63
    read, out = blocks_read(1, 64, 1000, kv=kv)
    assert read == kv * per_row  # (before: kv * 64 * 63)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    split_read, split_out = blocks_read(1, 64, 1000, kv=kv, split_n=256)
    assert split_read == kv * per_row
    assert torch.allclose(split_out, out, atol=1e-6, rtol=1e-6) and not torch.equal(split_out, out)


@needs_triton
def test_the_rows_of_a_tile_share_each_block_and_a_window_starts_at_its_block():
    """16 tree rows (depths 1 to 6) in one 16-row tile read each block once for all of them: 63
    blocks per key-value head, not 16 x 63. A sliding-window row (window 100) reads only the blocks
    its window
    touches: from block (1001 - 100) // 16 = 56 to 62."""
    kv = 2
    read, _ = blocks_read(16, 64, 1000, kv=kv, tile_rows=16)
    assert read == kv * 63
    read, _ = blocks_read(1, 64, 1000, window=100, kv=kv)
    assert read == kv * (63 - (1001 - 100) // kta.BLOCK_N) == kv * 7


def test_the_reference_gives_pad_rows_zeros():
    k, v = caches()
    q = queries(4)
    tails, lens = random_rows(4, 20, __import__("numpy").random.default_rng(1))
    full = kta.reference(q, k, v, torch.tensor(20), tails, lens, 0.2)
    some = kta.reference(q, k, v, torch.tensor(20), tails, lens, 0.2, rows=torch.tensor(2))
    assert torch.equal(some[:2], full[:2]) and torch.equal(some[2:], torch.zeros_like(some[2:]))
