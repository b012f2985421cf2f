"""The row-exact tree attention (inference/kernel_tree_attention.py): the torch reference on CPU tensors,
and the Triton kernel under the interpreter (TRITON_INTERPRET=1, skipped without triton). A row's bits are
the same alone or among 64 rows, and a tree row's (its ancestors at scattered slots) equal the plain row's
with the same virtual sequence (its ancestors compacted into the prefix), at starts 0, 1, BLOCK_N - 1 and
more, depths 1 to the maximum; both are within bf16 rounding of a float64 attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headway.inference import kernel_tree_attention as kta

ROOT = Path(__file__).resolve().parents[1]
KV, GROUP, HD, CAP, DEPTH = 2, 3, 32, 96, 6


# where the kernels run: the GPU when there is one (scripts/gpu_check.sh reruns these tests there), else CPU
# tensors (the Triton kernel in its interpreter; tests/conftest.py sets TRITON_INTERPRET=1)
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
    """float64 attention of each row over its gathered virtual sequence (its last `window` positions)."""
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
    """The tree row's ancestors sit at scattered slots; the plain row has them compacted after the prefix (the
    cache after the path is kept) and is itself the one-token step that follows."""
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
    """The CPU emulation runs only the blocks up to the longest row's last key (a host number): every block
    past a row's length leaves it unchanged, so the bits are those of the pass over the whole cache."""
    import numpy as np

    k, v = caches()
    q = queries(16)
    tails, lens = random_rows(16, 33, np.random.default_rng(9))
    tails = tails.clamp(max=40)  # (every row ends by slot 40: block 2 of 6)
    whole = kta.reference(q, k, v, torch.tensor(33), tails, lens, HD**-0.5, window=window)
    reach = -(-(33 + DEPTH) // kta.BLOCK_N)
    trimmed = kta.reference(q, k, v, torch.tensor(33), tails, lens, HD**-0.5, blocks=reach, window=window)
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
        "from headway.inference import kernel_tree_attention as k\n"
        "assert k.triton is None and not k.triton_available()\n"
        "import torch\n"
        "out = k.tree_attention(torch.randn(2, 4, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8),"
        " torch.tensor(3), torch.tensor([[3, 0], [4, 5]]), torch.tensor([1, 2]), 0.3)\n"
        "assert out.shape == (2, 32)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
