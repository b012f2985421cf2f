"""target.linear_weights=float16 (packed fp16 decoder weights, float32 compute) and onednn (bf16
weights prepacked for oneDNN). The layers compute what the format says, speculative decoding equals
the format's plain decoding (every engine for float16; the row-exact static engine for bf16), and
the settings a format cannot serve
are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headway.errors import HeadwayError
from headway.inference.api import drafter_dtype
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.engines.runner import make_runner, static_supported
from headway.inference.generate import greedy_generate, speculative_generate
from headway.target.config import TargetConfig
from headway.target.loading import export_target, load_target
from headway.target.packed_capability import kernels_missing
from headway.target.packed_float16 import Float16Linear
from headway.target.packed_formats import row_linear
from headway.target.packed_mkl import MKLLinear
from headway.target.packed_model import fewest_rows, linear_weights, pack_head_linear_weights
from headway.target.packed_onednn import BF16_PROMPT_ROWS, OneDNNLinear
from headway.target.packed_stream import STREAM_MAX_ROWS, StreamLinear
from headway.target.stream_kernel import bf16_build as stream_bf16_build
from headway.target.stream_kernel import stream_kernel
from tests.helpers.decode_helpers import chat_ids, load_packed
from tests.inference.drafters.test_hybrid import ngram_only
from tests.kinds.test_eagle import random_head


def assert_speculative_equals_plain(t, heads, engine: str) -> None:
    """EAGLE-3 and n-gram trees decode two prompts exactly as the engine's plain greedy decoding
    does."""
    stop = [t.tokenizer.eos_token_id]
    for text in [
        "What is two plus three? Two plus three is five.",
        "Write a short poem about the sea and the sea.",
    ]:
        ids = chat_ids(t, text)
        ref = greedy_generate(t.model, ids, 32, stop, engine=engine)
        for drafter in (
            EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8),
            ngram_only(0.05, min_ngram=1),
        ):
            assert (
                speculative_generate(t.model, drafter, ids, 32, stop, engine=engine).tokens
                == ref.tokens
            ), engine


@pytest.mark.parametrize("bias", [False, True])
def test_float16_linear_is_float32_math_on_rounded_weights(bias: bool):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias)
    packed = Float16Linear(lin)
    for shape in [(1, 64), (5, 64), (1, 7, 64)]:
        x = torch.randn(*shape)
        ref = F.linear(x, lin.weight.half().float(), lin.bias)  # the bias stays float32
        out = packed(x)
        assert out.shape == (*shape[:-1], 48)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # the weights really are rounded
        assert (out - F.linear(x, lin.weight, lin.bias)).abs().max() > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_speculative_decoding_equals_plain_decoding_with_float16_weights(tiny_dirs, arch: str):
    t = load_packed(tiny_dirs[arch])
    assert linear_weights(t.model) == "float16"
    assert all(not isinstance(m, nn.Linear) for m in t.model.model.layers.modules())
    assert isinstance(t.model.lm_head, Float16Linear) and t.model.lm_head.weight.shape == (
        t.config.vocab_size,
        t.config.hidden_size,
    )
    heads = random_head(t, "eagle3").float()
    # as SpeculativeDecoder.load does beside a packed target
    assert pack_head_linear_weights(heads) > 0
    # (the compiled engine with float16 weights: test_float16_weights_compile_without_graph_breaks
    # and test_bf16_compiles_row_exact_without_graph_breaks[float16]; gemma3: fused parts, hf only)
    for engine in ("hf", "static") if static_supported(t.model) else ("hf",):
        assert_speculative_equals_plain(t, heads, engine)


def test_float16_weights_refuse_what_they_cannot_serve(tiny_dirs, tmp_path):
    with pytest.raises(HeadwayError, match="CPU format for float32 or bfloat16 targets"):
        load_target(
            TargetConfig(
                name_or_path=str(tiny_dirs["llama"]),
                device="cpu",
                num_threads=1,
                dtype="float64",
                linear_weights="float16",
            )
        )
    with pytest.raises(HeadwayError, match="target.linear_weights=.int8. is not allowed"):
        TargetConfig(linear_weights="int8")
    t = load_packed(tiny_dirs["llama"])
    with pytest.raises(HeadwayError, match="export with target.linear_weights=native"):
        export_target(t, tmp_path / "out", dtype="float32")
    from headway.heads.config import LoraConfig
    from headway.train.setup_heads import add_lora

    with pytest.raises(HeadwayError, match="train with target.linear_weights=native"):
        add_lora(t.model, LoraConfig(enabled=True))


@torch.inference_mode()
def test_float16_linear_is_exact_bf16_math_for_bf16_weights():
    """A bf16 target's weights are float16 values (same mantissa, smaller exponent range): the
    float16 format runs its linears as bf16 math (exact products, float32 sums, bf16 out), scaling a
    matrix of tiny weights by a power of two into float16's range, and refusing one that no single
    scale fits."""
    torch.manual_seed(0)
    for scale in (1.0, 1e-6):  # 1e-6: below float16's normal range, held exactly only once scaled
        lin = nn.Linear(96, 40, bias=True).bfloat16()
        with torch.no_grad():
            lin.weight.mul_(scale)
            lin.bias.mul_(scale)
        packed = Float16Linear(lin)
        assert packed.scale == 1.0 if scale == 1.0 else packed.scale < 1.0
        x = torch.randn(9, 96).bfloat16()
        out = packed(x)
        assert out.dtype == torch.bfloat16
        ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        assert (
            (out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-30
        ).all()  # within bf16's rounding of the sum
        alone = torch.cat([packed(x[i : i + 1]) for i in range(9)])
        for rows in (2, 3, 4, 9):
            assert torch.equal(
                torch.cat([packed(x[i : i + rows]) for i in range(0, 9 - rows + 1, rows)]),
                alone[: (9 // rows) * rows],
            ), rows
    wide = nn.Linear(8, 4, bias=False).bfloat16()
    with torch.no_grad():
        wide.weight.copy_(torch.tensor([1e4, 1e-9] * 16).view(4, 8))
    with pytest.raises(
        HeadwayError, match="do not fit float16 at any one scale.*use target.linear_weights=onednn"
    ):
        Float16Linear(wide)
    Float16Linear(wide, exact=False)  # a draft head's weights may round: drafts only steer speed


# fbgemm's kernels by instruction set: AVX2 is what AVX2-only CPUs run, forced here on any x86 CPU
# (fbgemm and ATen read these variables at start); "native" is this CPU's own.
FBGEMM_ISAS = {
    "native": {},
    "avx2": {
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}

ROW_COUNTS = """
import torch
from torch import nn
from headway.target.packed_fbgemm import fbgemm_rows_vary
from headway.target.packed_float16 import Float16Linear
torch.manual_seed(0)
torch.set_num_threads({threads})
for out_features, in_features in [(960, 576), (576, 1536), (4096, 576)]:  # the default target's sizes
    packed = Float16Linear(nn.Linear(in_features, out_features, bias=False).bfloat16())
    x = torch.randn(40, in_features).bfloat16()
    alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
    bad = [n for n in range(2, 41) if not torch.equal(packed(x[:n]), alone[:n])]
    assert not bad, (out_features, in_features, bad)
print("kernels:", torch.backends.cpu.get_cpu_capability(), "fbgemm rows vary:", fbgemm_rows_vary())
"""


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", list(FBGEMM_ISAS))
def test_float16_linear_gives_a_bf16_row_the_same_bits_for_any_row_count(isa: str, threads: int):
    """fbgemm's AVX2 float16 kernels give a row other bits in a call of 1 or 2 rows than in one of 3
    to 6 (AVX512's do not): bf16 speculative decoding then left plain decoding on AVX2 CPUs.
    Float16Linear chunks its calls there, so a row's bits never depend on the row count or the
    thread count, under either instruction
    set's kernels."""
    env = {**os.environ, **FBGEMM_ISAS[isa]}
    res = subprocess.run(
        [sys.executable, "-c", ROW_COUNTS.format(threads=threads)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    if isa == "avx2":  # the chunked path ran
        assert "kernels: AVX2 fbgemm rows vary: True" in res.stdout, res.stdout


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16, reason="this CPU has no oneDNN bf16 kernels (AVX512 needed)"
)


@needs_onednn_bf16
def test_onednn_linear_is_bf16_math_on_the_same_weights():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).bfloat16()
    packed = OneDNNLinear(lin)
    for shape in [(1, 96), (5, 96), (1, 7, 96)]:
        x = torch.randn(*shape).bfloat16()
        out = packed(x)
        assert out.shape == (*shape[:-1], 40) and out.dtype == torch.bfloat16
        # exact products, float32 sums
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@needs_onednn_bf16
@torch.inference_mode()
def test_onednn_linear_gives_a_row_the_same_bits_for_any_row_count():
    """oneDNN takes another kernel for one row than for more; OneDNNLinear pads few rows
    (ONEDNN_PAD_ROWS), so a row's result never depends on how many rows came with it: what row-exact
    bf16 decoding relies on (the default target's projection sizes and lm_head width)."""
    torch.manual_seed(0)
    for out_features, in_features in [(960, 576), (576, 1536), (4096, 576)]:
        packed = OneDNNLinear(nn.Linear(in_features, out_features, bias=False).bfloat16())
        x = torch.randn(9, in_features).bfloat16()
        alone = torch.cat([packed(x[i : i + 1]) for i in range(9)])
        for rows in (2, 3, 4, 5, 9):
            assert torch.equal(
                torch.cat([packed(x[i : i + rows]) for i in range(0, 9 - rows + 1, rows)]),
                alone[: (9 // rows) * rows],
            ), (out_features, rows)


def fused_formats():
    return ["float16"] + (["onednn"] if ONEDNN_BF16 else [])


@pytest.mark.parametrize("fmt", fused_formats())
@torch.inference_mode()
def test_fused_projections_compute_the_separate_linears(tiny_dirs, fmt: str):
    """Packed formats stack each layer's q/k/v projections into one weight and gate/up into another:
    the model's own forward (through the parts that replace the linears) and Headway's static engine
    (one call) give what the separate linears would on the format's rounded weights, and the same
    logits as each other."""
    dtype = {"float16": "float32", "onednn": "bfloat16"}[fmt]
    native = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype=dtype)
    )
    t = load_target(
        TargetConfig(
            name_or_path=str(tiny_dirs["llama"]),
            device="cpu",
            num_threads=1,
            dtype=dtype,
            linear_weights=fmt,
        )
    )
    x = torch.randn(3, t.config.hidden_size).to(getattr(torch, dtype))
    for layer, ref in zip(t.model.model.layers, native.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.headway_qkv is not None and mlp.headway_gate_up is not None
        for part, lin in [
            (attn.q_proj, ref.self_attn.q_proj),
            (attn.k_proj, ref.self_attn.k_proj),
            (attn.v_proj, ref.self_attn.v_proj),
            (mlp.gate_proj, ref.mlp.gate_proj),
            (mlp.up_proj, ref.mlp.up_proj),
        ]:
            w = lin.weight.half().float() if fmt == "float16" else lin.weight.float()
            torch.testing.assert_close(
                part(x).float(), F.linear(x.float(), w), rtol=1e-2, atol=1e-2
            )
        q, k, v = attn.headway_qkv(x)
        assert (
            torch.equal(q, attn.q_proj(x))
            and torch.equal(k, attn.k_proj(x))
            and torch.equal(v, attn.v_proj(x))
        )
    ids = torch.arange(10, 30)
    hf, static = make_runner(t.model, 64, "hf"), make_runner(t.model, 64, "static")
    tol = {"float16": 1e-4, "onednn": 5e-2}[fmt]
    for step in (ids, torch.tensor([5])):
        a, _ = hf.forward(step)
        b, _ = static.forward(step)
        torch.testing.assert_close(a[-1].float(), b[-1].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", "float16"), ("qwen2", "float16")]
    + ([("llama", "onednn"), ("qwen2", "onednn")] if ONEDNN_BF16 else []),
)
def test_speculative_decoding_equals_plain_decoding_on_packed_bf16_weights(
    tiny_dirs, arch: str, fmt: str
):
    t = load_packed(tiny_dirs[arch], fmt, "bfloat16")
    assert linear_weights(t.model) == fmt
    assert all(not isinstance(m, nn.Linear) for m in t.model.model.layers.modules())
    assert (
        isinstance(t.model.lm_head, (OneDNNLinear, Float16Linear))
        and t.model.lm_head.weight.dtype == torch.bfloat16
    )
    heads = random_head(t, "eagle3").bfloat16()
    assert pack_head_linear_weights(heads, fmt) > 0
    assert_speculative_equals_plain(t, heads, "static")


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bf16 kernels for this CPU")
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_bf16_float16_weights_take_onednn_for_a_prompts_rows(bias: bool):
    """bf16 calls of BF16_PROMPT_ROWS rows or more (prompts) run on a oneDNN-packed copy of the bf16
    weight, with its bits; fewer rows (decoding steps, trees) on fbgemm's float16 kernel, each row
    the same bits at any
    such count."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias).bfloat16()
    f16, dnn = Float16Linear(lin), OneDNNLinear(lin)
    x = torch.randn(BF16_PROMPT_ROWS + 5, 96).bfloat16()
    assert f16.prompt is not None and torch.equal(f16(x), dnn(x))
    assert torch.equal(f16(x[:BF16_PROMPT_ROWS]), dnn(x[:BF16_PROMPT_ROWS]))
    below = f16(x[: BF16_PROMPT_ROWS - 1])
    fbgemm = F.linear(
        x[: BF16_PROMPT_ROWS - 1].float(),
        lin.weight.float(),
        None if lin.bias is None else lin.bias.float(),
    )
    torch.testing.assert_close(below.float(), fbgemm.bfloat16().float(), rtol=1e-2, atol=1e-2)
    assert all(
        torch.equal(f16(x[i : i + 1]), below[i : i + 1]) for i in range(0, BF16_PROMPT_ROWS - 1, 7)
    )
    # float32 weights: fbgemm for every row count
    assert Float16Linear(nn.Linear(96, 40)).prompt is None


@pytest.mark.parametrize("fmt", ["float16", "stream"])
def test_speculative_decoding_after_a_long_prompt_equals_plain_on_bf16_weights(tiny_dirs, fmt: str):
    """A prompt long enough to leave the decoding kernels (BF16_PROMPT_ROWS: float16 weights' oneDNN
    copy, stream weights' oneDNN copy or float32 linear), then EAGLE-3 and n-gram trees on them
    (fbgemm, the bf16 streaming kernel)."""
    if fmt == "float16" and not ONEDNN_BF16:
        pytest.skip("oneDNN has no bf16 kernels for this CPU")
    if kernels_missing(fmt, torch.bfloat16):
        pytest.skip(kernels_missing(fmt, torch.bfloat16))
    t = load_packed(tiny_dirs["llama"], fmt, "bfloat16")
    heads = random_head(t, "eagle3").bfloat16()
    pack_head_linear_weights(heads, fmt)
    ids = chat_ids(t, "Repeat this list twice: " + ", ".join(f"item {i}" for i in range(40)))
    assert len(ids) >= BF16_PROMPT_ROWS
    stop = [t.tokenizer.eos_token_id]
    ref = greedy_generate(t.model, ids, 32, stop, engine="static")
    for drafter in (
        EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8),
        ngram_only(0.05, min_ngram=1),
    ):
        assert (
            speculative_generate(t.model, drafter, ids, 32, stop, engine="static").tokens
            == ref.tokens
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_onednn_weights_are_float32_math_and_decode_exactly(tiny_dirs, arch: str):
    """float32 weights prepacked for oneDNN (one-row steps that use every thread): the layers give
    float32's products on the same weights, and speculative decoding equals this format's plain
    decoding on every engine."""
    t = load_packed(tiny_dirs[arch], "onednn", "float32")
    assert linear_weights(t.model) == "onednn" and isinstance(t.model.lm_head, OneDNNLinear)
    lin = nn.Linear(96, 40, bias=True)
    x = torch.randn(5, 96)
    torch.testing.assert_close(OneDNNLinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)
    heads = random_head(t, "eagle3")
    for engine in ("hf", "static"):
        assert_speculative_equals_plain(t, heads, engine)


needs_mkl = pytest.mark.skipif(
    kernels_missing("mkl", torch.float32) is not None, reason="this torch build has no MKL"
)


@needs_mkl
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_mkl_weights_are_float32_math_and_decode_exactly(tiny_dirs, arch: str):
    """float32 weights prepacked for MKL's sgemm (one-token steps through it, other row counts
    through torch's linear): float32's products on the same weights for one row and for several, and
    speculative decoding equals this format's plain decoding on every engine."""
    t = load_packed(tiny_dirs[arch], "mkl", "float32")
    assert linear_weights(t.model) == "mkl" and isinstance(t.model.lm_head, MKLLinear)
    lin = nn.Linear(96, 40, bias=True)
    packed = MKLLinear(lin)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_linear(packed)(x), lin(x), rtol=1e-5, atol=1e-5)
    heads = random_head(t, "eagle3")
    for engine in ("hf", "static"):
        assert_speculative_equals_plain(t, heads, engine)
    with pytest.raises(
        HeadwayError, match="target.linear_weights=mkl is a CPU format for float32 targets"
    ):
        load_packed(tiny_dirs[arch], "mkl", "bfloat16")


needs_stream = pytest.mark.skipif(
    kernels_missing("stream", torch.float32) is not None,
    reason=str(kernels_missing("stream", torch.float32)),
)


@needs_stream
@pytest.mark.parametrize("bias", [False, True])
def test_stream_linear_gives_a_row_the_same_bits_for_any_rows_threads_and_vector_width(bias: bool):
    """The streaming kernel computes each output from its own row alone, in one fixed order: a row
    gets the same bits alone, among 1 to 32 rows (read one weight row after another, or four weight
    rows at a time), at 1 or 2 threads, and through the AVX-512 and the AVX2 build (where this CPU
    runs both), and float32's product to within float32 rounding."""
    ext = stream_kernel()
    isas = [isa for isa in ("avx512", "avx2") if _runs(ext, isa)]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        # the default target's sizes, and ragged ones (inputs not a multiple of 16, outputs not of
        # 4)
        for out_features, in_features in [(960, 576), (576, 1536), (67, 40), (5, 3)]:
            lin = nn.Linear(in_features, out_features, bias=bias)
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            x = torch.randn(32, in_features)
            torch.set_num_threads(1)
            alone = torch.cat(
                [ext.stream_linear_isa(x[i : i + 1], w, b, isas[0]) for i in range(32)]
            )
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=1e-5)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for isa in isas:
                    for rows in (1, 2, 3, 4, 5, 6, 7, 16, 32):
                        assert torch.equal(
                            ext.stream_linear_isa(x[:rows], w, b, isa), alone[:rows]
                        ), (
                            out_features,
                            in_features,
                            isa,
                            n_threads,
                            rows,
                        )
            packed = StreamLinear(lin)
            assert torch.equal(packed(x[:7]), alone[:7]) and torch.equal(
                row_linear(packed)(x[:3]), alone[:3]
            )
            # a prompt's rows (more than the kernel takes): oneDNN's linear over the weight as
            # loaded, torch's without
            prompt = torch.randn(STREAM_MAX_ROWS + 8, in_features)
            if kernels_missing("onednn", torch.float32):
                want = F.linear(prompt, w, b)
            else:
                want = torch.ops.mkldnn._linear_pointwise.default(prompt, w, b, "none", [], "")
            assert torch.equal(packed(prompt), want) and torch.equal(
                row_linear(packed)(prompt), want
            )
    finally:
        torch.set_num_threads(threads)


def _runs(ext, isa: str) -> bool:
    try:
        ext.stream_linear_isa(torch.zeros(1, 16), torch.zeros(1, 16), None, isa)
    except RuntimeError:
        return False
    return True


@needs_stream
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_stream_weights_decode_exactly(tiny_dirs, arch: str):
    """float32 weights through the streaming kernel (decoding steps) and torch's linear (prompts):
    speculative decoding equals this format's plain decoding on every engine, and a bf16 target is
    refused with the fix."""
    t = load_packed(tiny_dirs[arch], "stream", "float32")
    assert linear_weights(t.model) == "stream" and isinstance(t.model.lm_head, StreamLinear)
    heads = random_head(t, "eagle3")
    assert pack_head_linear_weights(heads, "stream") > 0
    for engine in ("hf", "static"):
        assert_speculative_equals_plain(t, heads, engine)
    with pytest.raises(
        HeadwayError,
        match="target.linear_weights=stream is a CPU format for float32 or bfloat16 targets",
    ):
        load_packed(tiny_dirs[arch], "stream", "float16")


needs_stream_bf16 = pytest.mark.skipif(
    kernels_missing("stream", torch.bfloat16) is not None,
    reason=str(kernels_missing("stream", torch.bfloat16)),
)


@needs_stream_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_stream_linear_gives_a_row_the_same_bits_for_any_rows_and_threads(bias: bool):
    """The bf16 streaming kernel (either build) computes each output from its own row and weight row
    alone, in one fixed order, over its packed copy of the weight: a row gets the same bits alone,
    among 1 to 33 rows and at 1 or 2 threads, and the exact product rounded to bf16 (to within one
    bf16 step where the float32 sum
    sits at
    a tie)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        # the default target's sizes, and ragged ones (inputs not a multiple of 32, outputs not of
        # 4)
        for out_features, in_features in [(960, 576), (576, 1536), (67, 40), (5, 3)]:
            lin = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
            packed = StreamLinear(lin)
            assert packed.packed is not None
            x = torch.randn(33, in_features).bfloat16()
            torch.set_num_threads(1)
            alone = torch.cat([packed(x[i : i + 1]) for i in range(33)])
            ref = F.linear(
                x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
            )
            torch.testing.assert_close(
                alone.double(), ref.bfloat16().double(), rtol=8e-3, atol=1e-3
            )
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (1, 2, 3, 4, 5, 8, 16, 33):
                    assert torch.equal(packed(x[:rows]), alone[:rows]), (
                        out_features,
                        in_features,
                        n_threads,
                        rows,
                    )
            assert torch.equal(row_linear(packed)(x[:3]), alone[:3])
            # a prompt's rows go through oneDNN's kernels over a prepacked copy where the CPU has
            # them, else through torch's float32 linear over the weight in float32, rounded once to
            # bf16
            prompt = torch.randn(BF16_PROMPT_ROWS, in_features).bfloat16()
            if packed.prompt is not None:
                want = OneDNNLinear(lin)(prompt)
            else:
                b32 = None if lin.bias is None else lin.bias.float()
                want = F.linear(prompt.float(), lin.weight.float(), b32).bfloat16()
            assert torch.equal(packed(prompt), want)
            assert (packed.prompt is None) == hasattr(
                packed, "weight"
            )  # the weight as loaded only where prompts read it
    finally:
        torch.set_num_threads(threads)


def _dpbf16_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] bf16 times weight [out, in] bf16 in vdpbf16ps's documented order, in float32:
    per block of 32 inputs, lane l adds the product of inputs 2l + 1, then of 2l (bf16 products are
    exact in float32, so each addition rounds once, as a fused multiply-add would); then lane l plus
    lane l + 8, + 4, + 2, + 1, the bias, and one rounding to bf16."""
    rows, n_in = x.shape
    pad = -n_in % 32
    xs = F.pad(x.float(), (0, pad)).view(rows, 1, -1, 16, 2)
    ws = F.pad(weight.float(), (0, pad)).view(1, weight.shape[0], -1, 16, 2)
    acc = torch.zeros(rows, weight.shape[0], 16)
    for kb in range(xs.shape[2]):
        acc = acc + xs[:, :, kb, :, 1] * ws[:, :, kb, :, 1]
        acc = acc + xs[:, :, kb, :, 0] * ws[:, :, kb, :, 0]
    for width in (8, 4, 2, 1):
        acc = acc[..., :width] + acc[..., width : 2 * width]
    y = acc[..., 0]
    return (y if bias is None else y + bias.float()).bfloat16()


@pytest.mark.skipif(stream_bf16_build() == "", reason="no bf16 streaming kernel here")
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_stream_avx2_build_follows_vdpbf16ps_order(bias: bool):
    """The AVX2 build of the bf16 streaming kernel (CPUs without AVX512-BF16; forced here on any CPU
    with AVX2) sums in the order vdpbf16ps documents, bit for bit: each output from its own row and
    weight row alone, whatever the row and thread counts."""
    torch.manual_seed(0)
    ext = stream_kernel()
    threads = torch.get_num_threads()
    try:
        for out_features, in_features in [(960, 576), (576, 1536), (67, 40), (5, 3)]:
            weight = torch.randn(out_features, in_features).bfloat16()
            b = torch.randn(out_features).bfloat16() if bias else None
            packed = torch.ops.headway_kernels.stream_pack_bf16(weight)
            x = torch.randn(9, in_features).bfloat16()
            want = _dpbf16_order(x, weight, b)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (1, 2, 3, 9):
                    got = ext.stream_linear_bf16_isa(x[:rows], packed, b, out_features, "avx2")
                    assert torch.equal(got, want[:rows]), (
                        out_features,
                        in_features,
                        n_threads,
                        rows,
                    )
    finally:
        torch.set_num_threads(threads)


@needs_stream_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_stream_weights_decode_exactly(tiny_dirs, arch: str):
    """bf16 weights through the bf16 streaming kernel (decoding steps, a one-token step unpadded;
    AVX512-BF16 or AVX2 build) and oneDNN's or float32 linear (prompts): speculative decoding equals
    this format's plain decoding on every engine (after a long
    prompt: test_speculative_decoding_after_a_long_prompt_equals_plain_on_bf16_weights)."""
    t = load_packed(tiny_dirs[arch], "stream", "bfloat16")
    assert linear_weights(t.model) == "stream" and fewest_rows(t.model) == 1
    heads = random_head(t, "eagle3")
    assert pack_head_linear_weights(heads, "stream") > 0
    for engine in ("hf", "static"):
        assert_speculative_equals_plain(t, heads, engine)


@needs_stream_bf16
def test_float32_stream_target_drafts_with_a_bf16_eagle3_head_exactly(tiny_dirs, monkeypatch):
    """inference.drafter_dtype=auto loads an EAGLE-3 head in bf16 beside a float32 target in the
    stream format where the CPU has AVX512-BF16 (its linears then stream half the bytes), and the
    target's dtype elsewhere (the AVX2 bf16 build included); the drafts only steer the speed, so
    speculative decoding still equals plain decoding."""
    t = load_packed(tiny_dirs["llama"], "stream", "float32")
    monkeypatch.setattr("headway.inference.api.stream_bf16_build", lambda: "avx512bf16")
    assert drafter_dtype("auto", "eagle3", t.model) == torch.bfloat16
    assert (
        drafter_dtype("auto", "eagle", t.model) == torch.float32
    )  # EAGLE-1 reads out through the target's lm_head
    assert drafter_dtype("target", "eagle3", t.model) == torch.float32
    assert drafter_dtype("bfloat16", "medusa", t.model) == torch.bfloat16
    for build in ("avx2", ""):
        monkeypatch.setattr("headway.inference.api.stream_bf16_build", lambda b=build: b)
        assert drafter_dtype("auto", "eagle3", t.model) == torch.float32
    heads = random_head(t, "eagle3").to(torch.bfloat16)
    assert pack_head_linear_weights(heads, "stream") > 0
    for engine in ("hf", "static"):
        assert_speculative_equals_plain(t, heads, engine)


def test_bf16_stream_weights_say_which_cpu_they_need(tiny_dirs, monkeypatch):
    """A CPU where the bf16 streaming kernel cannot run (no AVX2 with FMA, or no compiler): a bf16
    target is refused with the reason."""
    monkeypatch.setattr(
        "headway.target.packed_capability.stream_bf16_unavailable",
        lambda: "its bf16 kernel needs a CPU with AVX512-BF16, or AVX2 with FMA",
    )
    with pytest.raises(
        HeadwayError,
        match=r"target.linear_weights=stream: no kernels for it here \(its bf16 kernel needs a CPU with "
        r"AVX512-BF16, or AVX2 with FMA\)",
    ):
        load_packed(tiny_dirs["llama"], "stream", "bfloat16")


def test_stream_weights_say_why_they_cannot_run(tiny_dirs, monkeypatch):
    """Where the kernel did not build (no compiler) or the CPU lacks AVX2: one message with the
    reason and the fix."""
    monkeypatch.setattr(
        "headway.target.packed_capability.stream_unavailable",
        lambda: "it did not build here (no compiler)",
    )
    with pytest.raises(
        HeadwayError,
        match=r"target.linear_weights=stream: no kernels for it here "
        r"\(it did not build here \(no compiler\)\): use target.linear_weights=native",
    ):
        load_packed(tiny_dirs["llama"], "stream", "float32")


def test_onednn_weights_refuse_what_they_cannot_serve(tiny_dirs, monkeypatch):
    with pytest.raises(
        HeadwayError,
        match="target.linear_weights=onednn is a CPU format for bfloat16 or float32 targets .* set "
        "target.dtype=bfloat16",
    ):
        load_target(
            TargetConfig(
                name_or_path=str(tiny_dirs["llama"]),
                device="cpu",
                num_threads=1,
                dtype="float64",
                linear_weights="onednn",
            )
        )
    # a build without oneDNN
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(
        HeadwayError,
        match="target.linear_weights=onednn: no kernels for it here .* use target.linear_weights=native",
    ):
        load_target(
            TargetConfig(
                name_or_path=str(tiny_dirs["llama"]),
                device="cpu",
                num_threads=1,
                dtype="bfloat16",
                linear_weights="onednn",
            )
        )


def test_float16_weights_compile_without_graph_breaks(tiny_dirs):
    """Under inference.engine=compiled a packed float16 linear is one opaque op of the graph, not a
    break: the whole decoder stack stays 2 graphs (one token, a tree), as with native weights."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = load_packed(tiny_dirs["llama"])
    ids = chat_ids(t, "Write a short poem about the sea.")
    ref = greedy_generate(t.model, ids, 16, [t.tokenizer.eos_token_id], engine="static")
    drafter = ngram_only(0.05, min_ngram=1)
    assert (
        greedy_generate(t.model, ids, 16, [t.tokenizer.eos_token_id], engine="compiled").tokens
        == ref.tokens
    )
    assert (
        speculative_generate(
            t.model, drafter, ids, 16, [t.tokenizer.eos_token_id], engine="compiled"
        ).tokens
        == ref.tokens
    )
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize(
    "fmt",
    ["native", "float16"]
    + (["onednn"] if ONEDNN_BF16 else [])
    + (["stream"] if not kernels_missing("stream", torch.bfloat16) else []),
)
def test_bf16_compiles_row_exact_without_graph_breaks(tiny_dirs, fmt: str):
    """bf16 on the compiled engine is row-exact too: speculative decoding equals the compiled
    engine's plain decoding (EAGLE-3 and n-gram trees of every shape), and one graph of dynamic row
    count serves every step (a single token pads to 2 rows where the format needs it; RowAttention
    and the packed formats' linears are opaque ops), with no graph break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = load_target(
        TargetConfig(
            name_or_path=str(tiny_dirs["llama"]),
            device="cpu",
            num_threads=1,
            dtype="bfloat16",
            linear_weights=fmt,
        )
    )
    heads = random_head(t, "eagle3").bfloat16()
    if fmt != "native":
        pack_head_linear_weights(heads, fmt)
    assert_speculative_equals_plain(t, heads, "compiled")
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
