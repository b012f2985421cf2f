"""The static engine and its compiled form: the same logits and hidden states as the model's own
forward (prefill, tree, compaction), the same tokens in plain and speculative decoding, and a clear
refusal where it does
not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from headway.errors import HeadwayError
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.engines.runner import HFRunner, StaticRunner, make_runner, static_supported
from headway.inference.engines.static import layer_loop
from headway.inference.engines.static.plans import RowAttention
from headway.inference.engines.tree import build_tree
from headway.inference.generate import greedy_generate, speculative_generate
from headway.target.packed_model import rows_for_one
from tests.helpers.decode_helpers import chat_ids, engine_steps, load64, load_packed
from tests.kinds.test_eagle import random_head

STATIC = ["llama", "qwen2", "mistral"]


@pytest.mark.parametrize("arch,compiled", [(a, False) for a in STATIC] + [("qwen2", True)])
@torch.inference_mode()
def test_static_runner_matches_the_model_forward(tiny_dirs, arch: str, compiled: bool):
    t = load64(tiny_dirs[arch])
    assert static_supported(t.model)
    hf, static = HFRunner(t.model), StaticRunner(t.model, 64, compiled=compiled)
    # transformers' RMSNorm rounds to float32 inside; compiled code fuses the norm and skips that
    # rounding
    atol = 1e-6 if compiled else 1e-10
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    steps = [
        (torch.arange(10, 40), None, None),
        (torch.tensor([5, 6, 7, 8, 9, 10]), tree, [0, 1, 3]),
        (torch.tensor([11]), None, None),
        (torch.tensor([3, 4, 5, 6, 7, 8]), tree, [0, 2, 4, 5]),
        (
            torch.tensor([12, 13, 14, 15, 16, 17]),
            tree,
            [0, 1],
        ),  # a path already in place: nothing moves
        (torch.tensor([18, 19, 20, 21, 22, 23]), tree, [0]),
        (torch.tensor([24]), None, None),
    ]
    for ids, t_, keep in steps:
        (la, ha), (lb, hb) = hf.forward(ids, t_, hidden=True), static.forward(ids, t_, hidden=True)
        assert len(ha) == len(hb) == t.config.num_hidden_layers + 1
        assert torch.allclose(la, torch.stack([lb[i] for i in range(len(lb))]), atol=atol, rtol=0)
        assert all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(ha, hb))
        if keep:
            hf.keep(tree.size, keep)
            static.keep(tree.size, keep)
        assert hf.length == static.length


@pytest.mark.parametrize("arch", STATIC)
def test_static_and_dynamic_paths_give_the_same_tokens(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3")
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8)
    stop = [t.tokenizer.eos_token_id]
    for text in ["What is two plus three?", "Write a short poem about the sea."]:
        ids = chat_ids(t, text)
        ref = greedy_generate(t.model, ids, 32, stop, engine="hf")
        assert greedy_generate(t.model, ids, 32, stop, engine="static").tokens == ref.tokens
        for engine in ("hf", "static"):
            assert (
                speculative_generate(t.model, drafter, ids, 32, stop, engine=engine).tokens
                == ref.tokens
            )


def test_compiled_engine_gives_plain_decodings_tokens_and_reuses_its_graphs(tiny_dirs):
    """Speculative decoding on the compiled engine equals plain decoding on it (and on hf: float64
    leaves no near-ties), and one graph serves every tree size and cache length: only the
    single-token and the many-token case compile (2 graphs), not one per size, with or without
    hidden states, and for a tree that is only
    its root."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    stop = [t.tokenizer.eos_token_id]
    ids = chat_ids(t, "Write a short poem about the sea.")
    ref = greedy_generate(t.model, ids, 40, stop, engine="hf")
    assert greedy_generate(t.model, ids, 40, stop, engine="compiled").tokens == ref.tokens
    for depth, top_k, total in [(3, 3, 8), (2, 4, 5), (4, 2, 11)]:
        drafter = EagleDrafter(heads, t.config.num_hidden_layers, depth, top_k, total)
        res = speculative_generate(t.model, drafter, ids, 40, stop, engine="compiled")
        assert res.tokens == ref.tokens
    with torch.inference_mode():  # as the decoding loops run it
        runner = make_runner(t.model, 64, "compiled")
        runner.forward(torch.tensor(ids[:5]))
        runner.forward(
            torch.tensor([7]), build_tree([]), hidden=True
        )  # a hybrid step that drafted nothing
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("attention", ["cpp", "sdpa"])
@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", "native"), ("qwen2", "native"), ("llama", "float16")]
    + ([("llama", "onednn")] if ONEDNN_BF16 else []),
)
@torch.inference_mode()
def test_bf16_tree_rows_are_bit_identical_to_one_token_steps(
    tiny_dirs, arch: str, fmt: str, attention: str
):
    """In bf16 on a CPU every row of a tree step equals, bit for bit, the one-token step of that
    token after its ancestors: what makes greedy speculative decoding equal plain decoding in bf16
    (RowAttention by either `target.row_attention`, and the padding of few-row steps: `fewest_rows`,
    ONEDNN_PAD_ROWS)."""
    if attention == "cpp" and layer_loop.extension() is None:
        pytest.skip("the C++ extension does not build here")
    t = load_packed(tiny_dirs[arch], fmt, "bfloat16")
    prompt = torch.arange(10, 50)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]])
    nodes = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    spec = StaticRunner(t.model, 64, row_attention=attention)
    assert (spec.row_kernel is not None) == (attention == "cpp")
    spec.forward(prompt)
    rows, _ = spec.forward(nodes, tree, hidden=True)
    if (
        fmt != "native"
    ):  # the lm_head computes a few rows for the price of one: the root comes with the next nodes
        rows[0]
        together = min(tree.size, rows_for_one(t.model))
        assert sorted(rows.rows) == list(range(together)) and rows_for_one(t.model) > 1
    for leaf in (4, 5, 6):
        path = [i for i in range(tree.size) if tree.ancestors[leaf, i]]
        plain = StaticRunner(t.model, 64, row_attention=attention)
        plain.forward(prompt)
        for i in path:
            logits, _ = plain.forward(nodes[i : i + 1])
            assert torch.equal(logits[0], rows[i]), (leaf, i)


def _row_kernel(attention: str) -> Any:
    if attention == "sdpa":
        return None
    if layer_loop.extension() is None:
        pytest.skip("the C++ extension does not build here")
    return layer_loop.row_kernel("cpp")


@pytest.mark.parametrize(
    "attention,dtype", [("sdpa", torch.bfloat16), ("sdpa", torch.float32), ("cpp", torch.bfloat16)]
)
@torch.inference_mode()
def test_row_attention_gives_a_row_the_same_bits_alone_or_among_others(attention: str, dtype):
    """RowAttention at the default target's sizes (9 query heads over 3 key/value heads of 64, ~150
    visible slots): a row computed in a group of rows of the same length, or among rows of other
    lengths, equals that row computed alone, bit for bit. (Batched matmuls fail this: their result
    depends on the batch count.)"""
    kernel = _row_kernel(attention)
    cache_dtype = (
        torch.float32 if kernel else dtype
    )  # the runner keeps a row-exact cache in float32
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(3, 200, 64, generator=g).to(dtype).to(cache_dtype)
    v_cache = torch.randn(3, 200, 64, generator=g).to(dtype).to(cache_dtype)
    q = torch.randn(6, 9, 64, generator=g).to(dtype)  # [rows, heads, head_dim]
    tails = [
        [150],
        [151],
        [152],
        [150, 153],
        [151, 154],
        [150, 153, 155],
    ]  # each after the first 150 slots
    together = RowAttention(150, tails, q.device, kernel)(q, k_cache, v_cache, 0.125)
    for i, tail in enumerate(tails):
        alone = RowAttention(150, [tail], q.device, kernel)(q[i : i + 1], k_cache, v_cache, 0.125)
        assert torch.equal(together[i : i + 1], alone), i
    # rows that see the cache's first slots in order (plain decoding's, a chain's): the same bits as
    # the same keys gathered from elsewhere (the SDPA path reads the first in place)
    chain = RowAttention(150, [[150], [150, 151], [150, 151, 152]], q.device, kernel)
    if kernel is None:
        assert chain.slots is None and RowAttention(150, [[150, 152]], q.device).slots is not None
    moved_k, moved_v = k_cache.clone(), v_cache.clone()
    moved_k[:, 160:163], moved_v[:, 160:163] = k_cache[:, 150:153], v_cache[:, 150:153]
    gathered = RowAttention(150, [[160], [160, 161], [160, 161, 162]], q.device, kernel)
    assert torch.equal(
        chain(q[:3], k_cache, v_cache, 0.125), gathered(q[:3], moved_k, moved_v, 0.125)
    )


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    tail: list[int],
    scale: float,
) -> torch.Tensor:
    """One row's attention (q [heads, dim]) over the cache's first `start` slots, then `tail`, by
    torch: [heads * dim]."""
    slots = torch.tensor(list(range(start)) + tail)
    out = F.scaled_dot_product_attention(
        q[:, None], k_cache[:, slots], v_cache[:, slots], scale=scale, enable_gqa=True
    )
    return out.reshape(-1)


def _tail_moved_to_prefix(
    k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, tail: list[int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Copies of the caches with the tail's keys and values written right after the prefix, and the
    last of those slots: the same sequence as plain decoding sees it (all prefix, the row itself
    last)."""
    moved_k, moved_v = k_cache.clone(), v_cache.clone()
    moved_k[:, start : start + len(tail)] = k_cache[:, tail]
    moved_v[:, start : start + len(tail)] = v_cache[:, tail]
    return moved_k, moved_v, start + len(tail) - 1


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (4, 4, 8), (2, 1, 128), (6, 2, 24)]
)
@torch.inference_mode()
def test_the_row_attention_kernel_is_attention_and_fixed_per_row(
    heads: int, kv_heads: int, head_dim: int
):
    """The C++ row kernel computes softmax(q k^T * scale) v over each row's prefix and tail (float32
    rounding), and a row's bits do not depend on the prefix/tail split, the other rows, the padding
    rows or the
    thread count."""
    kernel = _row_kernel("cpp")
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, kv_heads, 90, head_dim, generator=g).unbind(0)
    q = torch.randn(5, heads, head_dim, generator=g)
    start, tails = 37, [[37], [37, 38], [37, 39], [37, 38, 40], [37, 39, 41, 42]]
    scale = head_dim**-0.5
    out = RowAttention(start, tails, q.device, kernel)(q, k_cache, v_cache, scale)
    for i, tail in enumerate(tails):
        torch.testing.assert_close(
            out[i], _attention(q[i], k_cache, v_cache, start, tail, scale), rtol=1e-5, atol=1e-5
        )
        # the same sequence with a longer prefix and a shorter tail (plain decoding's split): the
        # same bits
        moved_k, moved_v, last = _tail_moved_to_prefix(k_cache, v_cache, start, tail)
        alone = RowAttention(last, [[last]], q.device, kernel)(
            q[i : i + 1], moved_k, moved_v, scale
        )
        assert torch.equal(out[i : i + 1], alone), i
    # a one-token step padded to 3 rows: every row is the first
    padded = RowAttention(start, [[37]] * 3, q.device, kernel)
    assert padded.tails.shape[0] == 1
    assert torch.equal(padded(q[[0, 0, 0]], k_cache, v_cache, scale), out[[0, 0, 0]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = RowAttention(start, tails, q.device, kernel)(q, k_cache, v_cache, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, out)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 32), (8, 1, 16), (2, 1, 128), (6, 2, 24)]
)
@torch.inference_mode()
def test_every_row_attention_build_here_is_attention_and_fixed_per_row(
    heads: int, kv_heads: int, head_dim: int
):
    """Each build of the row kernel this CPU runs (AVX-512 and AVX2 with fused multiply-adds, the
    baseline without): attention within float32 rounding, and a row's bits whatever its prefix/tail
    split, the other rows or how many queries share a key head; the two FMA builds give the same
    bits (the lanes compute the same
    fused operations)."""
    ext = layer_loop.extension()
    if ext is None:
        pytest.skip("the C++ extension did not build here")
    print("row attention build:", ext.row_attention_build())
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(2, kv_heads, 120, head_dim, generator=g).unbind(0)
    q = torch.randn(4, heads, head_dim, generator=g)
    start, tails = 53, [[53], [53, 54], [53, 55], [53, 54, 56]]
    width = max(len(t) for t in tails)
    tail_t = torch.tensor([t + [0] * (width - len(t)) for t in tails])
    lens = torch.tensor([len(t) for t in tails])
    scale = head_dim**-0.5
    outs = {}
    for isa in ("avx512", "avx2", "base"):
        try:
            out = ext.row_attention_isa(q, k_cache, v_cache, start, tail_t, lens, scale, isa)
        except RuntimeError:  # this CPU has no such build
            continue
        outs[isa] = out
        for i, tail in enumerate(tails):
            torch.testing.assert_close(
                out[i], _attention(q[i], k_cache, v_cache, start, tail, scale), rtol=1e-5, atol=1e-5
            )
            moved_k, moved_v, last = _tail_moved_to_prefix(k_cache, v_cache, start, tail)
            alone = ext.row_attention_isa(
                q[i : i + 1],
                moved_k,
                moved_v,
                last,
                torch.tensor([[last]]),
                torch.tensor([1]),
                scale,
                isa,
            )
            assert torch.equal(out[i : i + 1], alone), (isa, i)
    assert "base" in outs
    if "avx512" in outs and "avx2" in outs:
        assert torch.equal(outs["avx512"], outs["avx2"])
    auto = ext.row_attention(q, k_cache, v_cache, start, tail_t, lens, scale, None, 0)
    assert torch.equal(auto, outs[ext.row_attention_build()])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_the_kernels_transposed_keys_change_no_bit(tiny_dirs, arch: str):
    """The row kernel's transposed key blocks, kept across steps and made stale by compaction and
    truncation, give the bits of transposing the prefix afresh at every step: logits of a prompt,
    one-token steps and trees with their compaction, then a truncation and new steps."""
    _row_kernel("cpp")
    t = load_packed(tiny_dirs[arch], "native", "bfloat16")
    runs = []
    for keep_transposed in (True, False):
        runner = StaticRunner(t.model, 96)
        assert runner.kt is not None
        if not keep_transposed:
            runner.kt = None
        out = engine_steps(runner, more=12)  # past the first blocks of 16 slots
        runner.truncate(45)
        for i in range(3):
            logits, _ = runner.forward(torch.tensor([30 + i]))
            out.append(logits[0])
        runs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_static_engine_is_refused_where_it_does_not_apply(tiny_dirs):
    t = load64(tiny_dirs["gemma3"])
    assert not static_supported(t.model)
    assert isinstance(make_runner(t.model, 32, "auto"), HFRunner)
    for engine in ("static", "compiled"):
        with pytest.raises(
            HeadwayError,
            match=rf"inference.engine={engine} cannot run this Gemma-3 \(text\) target: the static engine "
            r"does not implement .*; use inference.engine=auto or hf",
        ):
            make_runner(t.model, 32, engine)
