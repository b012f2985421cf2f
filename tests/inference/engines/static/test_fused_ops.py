"""The C++ loop's fused bf16 element-wise kernels (inference/engines/static/csrc/fused_ops.cpp):
ATen's results (rotary and the residual add bit for bit, RMSNorm and SiLU to within a bf16
rounding), the same bits at any thread count, and steps through them close to ATen's, with every
tree row still the one-token step of its token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headway.inference.engines.layer_step import LeanRMSNorm, rope_tables
from headway.inference.engines.static import layer_loop
from headway.inference.engines.static.runner import StaticRunner
from headway.inference.engines.tree import build_tree
from tests.helpers.decode_helpers import load_packed, with_threads

pytestmark = pytest.mark.skipif(
    layer_loop.extension() is None, reason="the C++ extension does not build here"
)


def _ext():
    return layer_loop.extension()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each bf16 value (8 bits of mantissa)."""
    return torch.ldexp(torch.ones_like(x.float()), torch.frexp(x.float()).exponent - 8)


@pytest.mark.parametrize("hidden", [576, 40, 7])  # whole blocks of 16, a tail, less than one block
def test_add_rms_norm_is_atens_to_a_rounding(hidden: int):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(300, hidden, generator=g) * 3).bfloat16()
    delta = torch.randn(300, hidden, generator=g).bfloat16()
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    total, normed = _ext().add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the residual add rounds as torch's bf16 add
    ref = LeanRMSNorm(w, 1e-5)(x + delta)
    assert (normed.float() - ref.float()).abs().le(_bf16_ulp(ref)).all()
    assert (normed == ref).float().mean() > 0.99
    same, alone = _ext().add_rms_norm(x, None, w, 1e-5)
    assert same is x or torch.equal(same, x)
    assert (alone.float() - LeanRMSNorm(w, 1e-5)(x).float()).abs().le(_bf16_ulp(alone)).all()


@pytest.mark.parametrize("heads,kv,dim", [(9, 3, 64), (4, 4, 24), (2, 1, 8)])
def test_rope_split_is_atens_bit_for_bit(heads: int, kv: int, dim: int):
    g = torch.Generator().manual_seed(dim)
    n = 50
    qkv = torch.randn(n, (heads + 2 * kv) * dim, generator=g).bfloat16()
    angles = torch.arange(n)[:, None].float() * torch.rand(dim // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    cos, sin = rope_tables(emb.cos().bfloat16()[None], emb.sin().bfloat16()[None])
    q, k, v = _ext().rope_split(qkv, cos, sin, heads, kv, dim)
    # engine_step.layer_step's rotation
    qk = qkv[:, : (heads + kv) * dim].view(n, heads + kv, dim)
    ref = qk * cos + qk.view(n, heads + kv, 2, dim // 2).flip(2).view(n, heads + kv, dim) * sin
    assert torch.equal(q, ref[:, :heads].transpose(0, 1))
    assert torch.equal(k, ref[:, heads:].transpose(0, 1))
    assert torch.equal(v, qkv[:, (heads + kv) * dim :].view(n, kv, dim).transpose(0, 1))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("inter", [1536, 36])
def test_silu_mul_is_atens_to_a_rounding(inter: int):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(200, 2 * inter, generator=g) * 4).bfloat16()
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -0.0, 0.0, 90.0, 200.0, 1e-30, -1e-30]).bfloat16()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]  # strided rows, as slices of one product
    out = _ext().silu_mul(gate, up)
    ref = F.silu(gate) * up
    # silu's exp is Headway's polynomial: its bf16 rounding may land one place off ATen's, and the
    # product then rounds again
    assert (out.float() - ref.float()).abs().le(2 * _bf16_ulp(ref) + 1e-30).all()
    assert (out == ref).float().mean() > 0.99


def test_silu_looked_up_for_many_rows_gives_the_computed_bits():
    # every bf16 value as a gate (NaNs, infinities and subnormals too), in a block of rows above the
    # lookup's threshold
    gate = (
        torch.arange(-32768, 32768, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .view(128, 512)
    )
    up = torch.randn(128, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    looked_up = _ext().silu_mul(gate, up)
    computed = torch.cat([_ext().silu_mul(gate[i : i + 1], up[i : i + 1]) for i in range(128)])
    assert torch.equal(looked_up.view(torch.int16), computed.view(torch.int16))


def test_the_thread_count_changes_no_bit():
    g = torch.Generator().manual_seed(1)
    n, hidden, heads, kv, dim, inter = 257, 96, 6, 2, 16, 80
    x, delta = (torch.randn(n, hidden, generator=g).bfloat16() for _ in range(2))
    w = torch.rand(hidden, generator=g).bfloat16()
    qkv = torch.randn(n, (heads + 2 * kv) * dim, generator=g).bfloat16()
    cos, sin = (
        torch.rand(n, 1, dim, generator=g).bfloat16(),
        torch.rand(n, 1, dim, generator=g).bfloat16(),
    )
    gate_up = torch.randn(n, 2 * inter, generator=g).bfloat16()

    def run():
        e = _ext()
        return [
            *e.add_rms_norm(x, delta, w, 1e-6),
            *e.rope_split(qkv, cos, sin, heads, kv, dim),
            e.silu_mul(gate_up[:, :inter], gate_up[:, inter:]),
        ]

    one, two = with_threads(1, run), with_threads(2, run)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@torch.inference_mode()
def test_fused_steps_are_close_to_atens_and_tree_rows_stay_one_token_steps(tiny_dirs, arch: str):
    t = load_packed(tiny_dirs[arch], "native", "bfloat16")
    fused = StaticRunner(t.model, 64, loop="cpp", fused_ops=True)
    aten = StaticRunner(t.model, 64, loop="cpp", fused_ops=False)
    assert fused.fused_ops and not aten.fused_ops
    ids = torch.arange(10, 40)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    nodes = torch.tensor([5, 6, 7, 8, 9])
    for runner_ids, runner_tree in [(ids, None), (nodes, tree)]:  # a prompt, then a tree
        _, ha = fused.forward(runner_ids, runner_tree, hidden=True)
        _, hb = aten.forward(runner_ids, runner_tree, hidden=True)
        for x, y in zip(ha, hb):
            assert (x.float() - y.float()).abs().max() <= 0.05 * y.float().abs().max()
    # each tree row is, bit for bit, the one-token step of its token after its ancestors
    spec = StaticRunner(t.model, 64, loop="cpp", fused_ops=True)
    spec.forward(ids)
    rows, _ = spec.forward(nodes, tree)
    for leaf in (3, 4):
        plain = StaticRunner(t.model, 64, loop="cpp", fused_ops=True)
        plain.forward(ids)
        for i in [i for i in range(tree.size) if tree.ancestors[leaf, i]]:
            logits, _ = plain.forward(nodes[i : i + 1])
            assert torch.equal(logits[0], rows[i]), (leaf, i)


def test_float32_rows_take_the_same_passes_without_the_bf16_roundings():
    """A float32 target's fused loop: residual add and norm, rotary with the split, SiLU with its
    product, each float32's ATen result to within float32 rounding, and the same bits at any thread
    count."""
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(300, 40, generator=g) * 3, torch.randn(300, 40, generator=g)
    w = torch.rand(40, generator=g) + 0.5
    total, normed = _ext().add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, LeanRMSNorm(w, 1e-5)(x + delta), rtol=2e-6, atol=2e-6)
    heads, kv, dim, n = 9, 3, 64, 50
    qkv = torch.randn(n, (heads + 2 * kv) * dim, generator=g)
    angles = torch.arange(n)[:, None].float() * torch.rand(dim // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    cos, sin = rope_tables(emb.cos()[None], emb.sin()[None])
    q, k, v = _ext().rope_split(qkv, cos, sin, heads, kv, dim)
    qk = qkv[:, : (heads + kv) * dim].view(n, heads + kv, dim)
    ref = qk * cos + qk.view(n, heads + kv, 2, dim // 2).flip(2).view(n, heads + kv, dim) * sin
    torch.testing.assert_close(q, ref[:, :heads].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, ref[:, heads:].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(v, qkv[:, (heads + kv) * dim :].view(n, kv, dim).transpose(0, 1))
    gate_up = torch.randn(200, 72, generator=g) * 4
    out = _ext().silu_mul(gate_up[:, :36], gate_up[:, 36:])
    torch.testing.assert_close(out, F.silu(gate_up[:, :36]) * gate_up[:, 36:], rtol=2e-6, atol=2e-6)

    def run():
        e = _ext()
        return [*e.add_rms_norm(x, delta, w, 1e-5), *e.rope_split(qkv, cos, sin, heads, kv, dim)]

    assert all(torch.equal(a, b) for a, b in zip(with_threads(1, run), with_threads(2, run)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_float32_fused_steps_are_atens(tiny_dirs, arch: str):
    t = load_packed(tiny_dirs[arch], "native", "float32")
    fused = StaticRunner(t.model, 64, loop="cpp", fused_ops=True)
    aten = StaticRunner(t.model, 64, loop="cpp", fused_ops=False, prompt_attention="sdpa")
    assert fused.fused_ops and not aten.fused_ops
    tree = build_tree([[0], [1], [0, 0]])
    for ids, step_tree in [
        (torch.arange(10, 40), None),
        (torch.tensor([5, 6, 7, 8]), tree),
        (torch.tensor([4]), None),
    ]:
        la, ha = fused.forward(ids, step_tree, hidden=True)
        lb, hb = aten.forward(ids, step_tree, hidden=True)
        for x, y in zip(ha, hb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(la[len(ids) - 1], lb[len(ids) - 1], rtol=1e-4, atol=1e-4)
