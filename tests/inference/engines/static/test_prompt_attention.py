"""A fresh prompt's causal attention in Headway's kernel
(inference/engines/static/csrc/prompt_attention.cpp). bf16, on the CPU's bf16 matrix units: as close
to float32 attention as torch's own bf16 attention is, for any length, head size and grouping, and
the same bits at any thread count; runs where oneDNN has a bf16 brgemm (AMX or AVX512-BF16),
elsewhere the layer loop keeps torch's attention and these tests skip. float32: float32 attention to
within float32 rounding, the same bits at any thread count, and an engine's float32 prompt through
it decodes as through torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headway.inference.engines.static import layer_loop
from headway.inference.engines.static.runner import StaticRunner
from headway.inference.engines.tree import build_tree
from headway.runtime import native_bf16
from tests.helpers.decode_helpers import load_packed

needs_brgemm = pytest.mark.skipif(
    layer_loop.extension() is None or not layer_loop.extension().prompt_attention_available(),
    reason="no bf16 brgemm on this CPU (or the C++ extension does not build here)",
)
needs_extension = pytest.mark.skipif(
    layer_loop.extension() is None, reason="the C++ extension does not build here"
)


def _inputs(n: int, heads: int, kv: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, dim, generator=g).bfloat16()
    k = torch.randn(kv, n, dim, generator=g).bfloat16()
    v = torch.randn(kv, n, dim, generator=g).bfloat16()
    return q, k, v


def _torch(q, k, v, dtype):
    o = F.scaled_dot_product_attention(
        q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), is_causal=True, enable_gqa=True
    )
    return o[0].transpose(0, 1).reshape(q.shape[1], -1).float()


# lengths: one row, less than a tile, tiles plus a tail, whole tiles; heads: grouped, one group, one
# per head
@needs_brgemm
@pytest.mark.parametrize(
    "n,heads,kv,dim",
    [(1, 9, 3, 64), (37, 9, 3, 64), (200, 4, 2, 128), (128, 4, 4, 32), (65, 2, 1, 16)],
)
@needs_brgemm
def test_causal_attention_as_close_to_float32_as_torchs_bf16(n: int, heads: int, kv: int, dim: int):
    q, k, v = _inputs(n, heads, kv, dim, seed=n)
    out = layer_loop.extension().prompt_attention(q, k, v, dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads * dim)
    exact = _torch(q, k, v, torch.float32)
    theirs = (_torch(q, k, v, torch.bfloat16) - exact).abs().max().item()
    ours = (out.float() - exact).abs().max().item()
    assert ours <= max(2 * theirs, 1e-2), (ours, theirs)
    # row 0 sees only itself: its output is its own value, to a bf16 rounding
    assert torch.allclose(
        out[0].float().view(heads, dim), v[:, 0].repeat_interleave(heads // kv, 0).float()
    )


@needs_brgemm
def test_a_later_key_never_changes_an_earlier_row():
    q, k, v = _inputs(150, 4, 2, 64, seed=3)
    out = layer_loop.extension().prompt_attention(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:, 100:] = 7.0
    v2[:, 100:] = -5.0
    changed = layer_loop.extension().prompt_attention(q, k2, v2, 0.125)
    assert torch.equal(out[:100], changed[:100])
    assert not torch.equal(out[100:], changed[100:])


@needs_brgemm
def test_the_thread_count_changes_no_bit():
    q, k, v = _inputs(300, 6, 2, 64, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer_loop.extension().prompt_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = layer_loop.extension().prompt_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_brgemm
def test_bad_shapes_are_refused():
    q, k, v = _inputs(10, 4, 3, 64)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        layer_loop.extension().prompt_attention(q, k, v, 0.125)


@pytest.mark.skipif(
    layer_loop.extension() is None
    or not native_bf16()
    or not (
        layer_loop.extension().prompt_attention_available()
        or layer_loop.extension().prompt_attention_f32_available()
    ),
    reason="bf16 prompts attend through torch here (no native bf16, or no brgemm for the kernel)",
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_an_engines_prompt_is_close_to_torchs_and_its_tree_rows_stay_one_token_steps(
    tiny_dirs, arch: str
):
    """On bf16 brgemm (AMX), or on float32 brgemm over the bf16 values (AVX512-BF16 without AMX)."""
    t = load_packed(tiny_dirs[arch], "native", "bfloat16")
    ours = StaticRunner(t.model, 160, loop="cpp", fused_ops=True, prompt_attention="auto")
    torchs = StaticRunner(t.model, 160, loop="cpp", fused_ops=True, prompt_attention="sdpa")
    assert ours.prompt_kernel and not torchs.prompt_kernel
    ids = torch.arange(3, 133)  # two blocks of rows and a tail
    _, ha = ours.forward(ids, hidden=True)
    _, hb = torchs.forward(ids, hidden=True)
    for x, y in zip(ha, hb):
        assert (x.float() - y.float()).abs().max() <= 0.05 * y.float().abs().max()
    # after the prompt, a tree's rows are the one-token steps of their tokens (runners of one model
    # share its
    # cache: one at a time)
    tree = build_tree([[0], [1], [0, 0]])
    nodes = torch.tensor([5, 6, 7])
    spec = StaticRunner(t.model, 160, loop="cpp", fused_ops=True, prompt_attention="auto")
    spec.forward(ids)
    rows, _ = spec.forward(nodes, tree)
    plain = StaticRunner(t.model, 160, loop="cpp", fused_ops=True, prompt_attention="auto")
    plain.forward(ids)
    for i in (0, 2):
        logits, _ = plain.forward(nodes[i : i + 1])
        assert torch.equal(logits[0], rows[i])


@needs_extension
@pytest.mark.parametrize(
    "n,heads,kv,dim",
    [(1, 9, 3, 64), (37, 9, 3, 64), (200, 4, 2, 128), (128, 4, 4, 32), (65, 2, 1, 16)],
)
def test_float32_causal_attention_is_float32_attention(n: int, heads: int, kv: int, dim: int):
    q, k, v = (t.float() for t in _inputs(n, heads, kv, dim, seed=n))
    out = layer_loop.extension().prompt_attention_f32(q, k, v, dim**-0.5)
    assert out.dtype == torch.float32 and out.shape == (n, heads * dim)
    exact = _torch(q.double(), k.double(), v.double(), torch.float64)
    assert (out.double() - exact).abs().max().item() < 2e-6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer_loop.extension().prompt_attention_f32(q, k, v, dim**-0.5)
        torch.set_num_threads(2)
        two = layer_loop.extension().prompt_attention_f32(q, k, v, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, out)


@pytest.mark.skipif(
    layer_loop.extension() is None or not layer_loop.extension().prompt_attention_f32_available(),
    reason="the float32 prompt kernel runs on AVX-512 CPUs (or the C++ extension does not build here)",
)
@pytest.mark.parametrize("fmt", ["native", "stream"])
@torch.inference_mode()
def test_a_float32_engines_prompt_through_the_kernel_is_torchs(tiny_dirs, fmt: str):
    t = load_packed(tiny_dirs["llama"], fmt, "float32")
    ours = StaticRunner(t.model, 160, loop="cpp", prompt_attention="auto")
    torchs = StaticRunner(t.model, 160, loop="cpp", prompt_attention="sdpa")
    assert ours.prompt_kernel and not torchs.prompt_kernel
    ids = torch.arange(3, 133)
    la, ha = ours.forward(ids, hidden=True)
    after_a = ours.forward(torch.tensor([5]))[0][0]
    lb, hb = torchs.forward(ids, hidden=True)
    after_b = torchs.forward(torch.tensor([5]))[0][0]
    for x, y in zip(ha, hb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert not torch.equal(
        ha[-1], hb[-1]
    )  # the kernel ran: its sums are ordered otherwise than torch's
    torch.testing.assert_close(la[-1], lb[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after_a, after_b, rtol=1e-4, atol=1e-4)
