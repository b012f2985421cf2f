"""target.linear_weights=float16 (packed fp16 decoder weights, float32 compute) and onednn (bf16 weights prepacked
for oneDNN). The layers compute what the format says, speculative decoding equals the format's plain decoding (every
engine for float16; the row-exact static engine for bf16), and the settings a format cannot serve are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headway.errors import HeadwayError
from headway.heads.packed_linear import Float16Linear, OneDNNLinear, linear_weights, pack_head_linear_weights
from headway.heads.target import TargetConfig, export_target, load_target
from headway.inference.draft_eagle import EagleDrafter
from headway.inference.engine import make_runner
from headway.inference.generate import greedy_generate, speculative_generate
from test_eagle import chat_ids, random_head
from test_hybrid import ngram_only


def load16(path, **kw):
    return load_target(TargetConfig(name_or_path=str(path), device="cpu", num_threads=1, dtype="float32",
                                    linear_weights="float16", **kw))


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
        assert (out - F.linear(x, lin.weight, lin.bias)).abs().max() > 0  # the weights really are rounded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_decoding_equals_plain_decoding_with_float16_weights(tiny_dirs, arch: str):
    t = load16(tiny_dirs[arch])
    assert linear_weights(t.model) == "float16"
    assert all(not isinstance(m, nn.Linear) for m in t.model.model.layers.modules())
    assert isinstance(t.model.lm_head, Float16Linear) and t.model.lm_head.weight.shape == (t.config.vocab_size, t.config.hidden_size)
    heads = random_head(t, "eagle3").float()
    assert pack_head_linear_weights(heads) > 0  # as SpeculativeDecoder.load does beside a packed target
    stop = [t.tokenizer.eos_token_id]
    for text in ["What is two plus three? Two plus three is five.", "Write a short poem about the sea and the sea."]:
        ids = chat_ids(t, text)
        for engine in ("hf", "static", "compiled"):
            ref = greedy_generate(t.model, ids, 32, stop, engine=engine)
            for drafter in (EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8), ngram_only(0.05, min_ngram=1)):
                assert speculative_generate(t.model, drafter, ids, 32, stop, engine=engine).tokens == ref.tokens, engine


def test_float16_weights_refuse_what_they_cannot_serve(tiny_dirs, tmp_path):
    with pytest.raises(HeadwayError, match="CPU format for float32 targets"):
        load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype="float64",
                                 linear_weights="float16"))
    with pytest.raises(HeadwayError, match="target.linear_weights=.int8. is not allowed"):
        TargetConfig(linear_weights="int8")
    t = load16(tiny_dirs["llama"])
    with pytest.raises(HeadwayError, match="export with target.linear_weights=native"):
        export_target(t, tmp_path / "out", dtype="float32")
    from headway.train.config import LoraConfig
    from headway.train.loop import add_lora

    with pytest.raises(HeadwayError, match="train with target.linear_weights=native"):
        add_lora(t.model, LoraConfig(enabled=True))


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU has no oneDNN bf16 kernels (AVX512 needed)")


@needs_onednn_bf16
def test_onednn_linear_is_bf16_math_on_the_same_weights():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).bfloat16()
    packed = OneDNNLinear(lin)
    for shape in [(1, 96), (5, 96), (1, 7, 96)]:
        x = torch.randn(*shape).bfloat16()
        out = packed(x)
        assert out.shape == (*shape[:-1], 40) and out.dtype == torch.bfloat16
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())  # exact products, float32 sums
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@needs_onednn_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_decoding_equals_plain_decoding_with_onednn_weights(tiny_dirs, arch: str):
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs[arch]), device="cpu", num_threads=1, dtype="bfloat16",
                                 linear_weights="onednn"))
    assert linear_weights(t.model) == "onednn"
    assert all(not isinstance(m, nn.Linear) for m in t.model.model.layers.modules())
    assert isinstance(t.model.lm_head, OneDNNLinear) and t.model.lm_head.weight.dtype == torch.bfloat16
    heads = random_head(t, "eagle3").bfloat16()
    assert pack_head_linear_weights(heads, "onednn") > 0
    stop = [t.tokenizer.eos_token_id]
    for text in ["What is two plus three? Two plus three is five.", "Write a short poem about the sea and the sea."]:
        ids = chat_ids(t, text)
        ref = greedy_generate(t.model, ids, 32, stop, engine="static")
        for drafter in (EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8), ngram_only(0.05, min_ngram=1)):
            assert speculative_generate(t.model, drafter, ids, 32, stop, engine="static").tokens == ref.tokens


def test_onednn_weights_refuse_what_they_cannot_serve(tiny_dirs, monkeypatch):
    with pytest.raises(HeadwayError, match="target.linear_weights=onednn is a CPU format for bfloat16 targets .* set "
                                           "target.dtype=bfloat16"):
        load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype="float32",
                                 linear_weights="onednn"))
    if ONEDNN_BF16:
        t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype="bfloat16",
                                     linear_weights="onednn"))
        with pytest.raises(HeadwayError, match="cannot compile target.linear_weights=onednn: use inference.engine=static"):
            make_runner(t.model, 32, "compiled")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a CPU or build without oneDNN bf16
    with pytest.raises(HeadwayError, match="no onednn linear kernels for this CPU .* use target.linear_weights=native"):
        load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype="bfloat16",
                                 linear_weights="onednn"))


def test_float16_weights_compile_without_graph_breaks(tiny_dirs):
    """Under inference.engine=compiled a packed float16 linear is one opaque op of the graph, not a break: the whole
    decoder stack stays 2 graphs (one token, a tree), as with native weights."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = load16(tiny_dirs["llama"])
    ids = chat_ids(t, "Write a short poem about the sea.")
    ref = greedy_generate(t.model, ids, 16, [t.tokenizer.eos_token_id], engine="static")
    drafter = ngram_only(0.05, min_ngram=1)
    assert greedy_generate(t.model, ids, 16, [t.tokenizer.eos_token_id], engine="compiled").tokens == ref.tokens
    assert speculative_generate(t.model, drafter, ids, 16, [t.tokenizer.eos_token_id], engine="compiled").tokens == ref.tokens
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
