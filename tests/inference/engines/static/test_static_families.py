"""The static engine (CPU) and its CUDA backend (on CPU tensors) on the families beyond
Llama/Qwen2/Mistral: Qwen3 (per-head q/k norms), SmolLM3 (NoPE layers), Llama with every rope type
computed by position (linear, llama3, yarn with its attention scaling), and the MoE families
Qwen3-MoE and Mixtral (routed row by row). The logits equal the model's own forward in float64,
greedy speculative decoding equals plain greedy decoding in float32 and in bf16 (its row-exact
format), the C++ layer loop gives the Python loop's bits where it runs a family and declines where
it does not, and what an engine does not run is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.inference.engines.cuda.runner import CudaRunner
from headway.inference.engines.runner import HFRunner, StaticRunner, static_supported
from headway.inference.engines.static import layer_loop
from headway.inference.engines.tree import build_tree
from headway.inference.generate import greedy_generate, speculative_generate
from headway.target.packed_capability import kernels_missing
from tests.helpers.capture_check import CheckingBackend
from tests.helpers.decode_helpers import engine_steps, load64, load_packed
from tests.helpers.tiny_models import make_tiny_model
from tests.inference.engines.cuda.test_cuda_capture import TREES, _sweep
from tests.inference.test_speculative_exact import WIDE_TREE, OracleDrafter, prompts_for

# Llama's rope types beside default and llama3 (tiny_models' llama3): each table a function of the
# position
ROPES = {
    "llama_linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama_yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
FAMILIES = ["qwen3", "smollm3", "qwen3_moe", "mixtral", "llama3", *ROPES]
MOE = ("qwen3_moe", "mixtral")
# bf16 decodes row-exact through the streaming format (every row the bits of a one-token step by
# construction); torch's native bf16 linear gives a row other bits over 2 rows than over 7 on some
# CPUs
BF16_FORMAT = "stream"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models of FAMILIES; the rope variants: the tiny Llama with its rope_parameters
    edited."""
    root = tmp_path_factory.mktemp("families")
    dirs = {f: make_tiny_model(f, root / f) for f in FAMILIES if f not in ROPES}
    for name, rope in ROPES.items():
        path = make_tiny_model("llama", root / name)
        cfg = json.loads((path / "config.json").read_text())
        cfg["rope_parameters"] = rope
        (path / "config.json").write_text(json.dumps(cfg))
        dirs[name] = path
    return dirs


STEPS = [
    (torch.arange(10, 40), False, None),
    (torch.tensor([5, 6, 7, 8, 9, 10]), True, [0, 1, 3]),
    (torch.tensor([11]), False, None),
    (torch.tensor([3, 4, 5, 6, 7, 8]), True, [0, 2, 4, 5]),
    (torch.tensor([12, 13, 14, 15, 16, 17]), True, [0]),
    (torch.tensor([18, 19]), False, None),  # a chain continuing the cache
    (torch.tensor([24]), False, None),
]


def _same_as_the_model(target, runner, rows_of_chains: str = "all") -> None:
    """Every step of STEPS on `runner` against the model's own forward (HFRunner), float64: logits
    and hidden states within 1e-10. rows_of_chains=last: a chain's logits only at its last row (the
    CUDA backend keeps only the prompt's)."""
    hf = HFRunner(target.model)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    for ids, is_tree, keep in STEPS:
        t_ = tree if is_tree else None
        (la, ha), (lb, hb) = hf.forward(ids, t_, hidden=True), runner.forward(ids, t_, hidden=True)
        last_only = rows_of_chains == "last" and t_ is None and len(ids) > 2
        for i in [len(ids) - 1] if last_only else range(len(ids)):
            assert torch.allclose(la[i], lb[i], atol=1e-10, rtol=0), i
        assert len(ha) == len(hb) == target.config.num_hidden_layers + 1
        assert all(torch.allclose(x, y, atol=1e-10, rtol=0) for x, y in zip(ha, hb))
        if keep:
            hf.keep(tree.size, keep)
            runner.keep(tree.size, keep)
        assert hf.length == runner.length


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_the_static_engine_is_the_models_forward(family_dirs, family: str):
    """Prompt, trees with their compaction, chains and single tokens: the model's logits and hidden
    states (float64), through the C++ layer loop where it covers the family and the Python loop
    where it does not."""
    t = load64(family_dirs[family])
    assert static_supported(t.model)
    rotary = t.model.model.rotary_emb
    assert rotary.rope_type == {
        "llama3": "llama3",
        **{k: v["rope_type"] for k, v in ROPES.items()},
    }.get(family, "default")
    if (
        family == "llama_yarn"
    ):  # yarn scales cos and sin: the tables come from the model's own rotary
        assert rotary.attention_scaling > 1.0
    runner = StaticRunner(t.model, 64)
    if layer_loop.extension() is not None:
        assert (runner._loop is None) == (family in MOE)
    _same_as_the_model(t, runner)


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_the_cuda_backend_on_cpu_tensors_is_the_models_forward(family_dirs, family: str):
    """Its fixed-shape steps (tree attention, device-side acceptance) give the model's logits, and
    its greedy speculative decoding plain greedy's tokens (float64)."""
    t = load64(family_dirs[family])
    with torch.inference_mode():
        _same_as_the_model(t, CudaRunner(t.model, 64, buckets=(1, 8, 16)), rows_of_chains="last")
    ids = t.tokenizer(prompts_for(t.tokenizer)[0], add_special_tokens=False)["input_ids"]
    ref = greedy_generate(t.model, ids, 32, [], engine="hf").tokens
    assert greedy_generate(t.model, ids, 32, [], engine="cuda").tokens == ref
    oracle = OracleDrafter(build_tree(WIDE_TREE), ref, t.config.vocab_size, 0)
    assert speculative_generate(t.model, oracle, ids, 32, [], engine="cuda").tokens == ref


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_the_cuda_backends_step_compiles_to_one_graph_without_host_syncs(family_dirs, family: str):
    """The q/k norms and NoPE layers keep the step capturable: one checked graph per bucket (no host
    sync, no data-dependent size, only the KV cache mutated), the eager step's bits, no recompile
    over a sweep."""
    t = load64(family_dirs[family])
    t.model.float()
    runner = CudaRunner(t.model, 96, buckets=(1, 12))
    eager = CudaRunner(t.model, 96, buckets=(1, 12), graphs=False)
    for r in (runner, eager):
        r.forward(torch.arange(5, 25))
    backend = CheckingBackend()
    runner.graphs.step = torch.compile(runner._step, backend=backend, fullgraph=True, dynamic=False)
    try:
        for n, (ids, parent, size, _) in enumerate(_sweep(runner, TREES[:3], steps=4)):
            if n == 1:
                torch.compiler.set_stance("fail_on_recompile")
            a, b = runner.step(ids, parent, size), eager.step(ids, parent, size)
            assert torch.equal(a[0][:size], b[0][:size]) and torch.equal(a[2], b[2])
            for r in (runner, eager):
                r.keep_path(size, torch.tensor([0]))
    finally:
        torch.compiler.set_stance("default")
    assert backend.graphs == 1
    assert backend.mutated and all(".cache." in name for name in backend.mutated), backend.mutated


def _format(dtype: str) -> str:
    fmt = BF16_FORMAT if dtype == "bfloat16" else "native"
    if fmt != "native" and kernels_missing(fmt, getattr(torch, dtype)):
        pytest.skip(kernels_missing(fmt, getattr(torch, dtype)))
    return fmt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "smollm3", "qwen3_moe", "mixtral", "llama_yarn"])
def test_greedy_speculative_decoding_is_plain_greedy_on_the_static_engine(
    family_dirs, family: str, dtype: str
):
    """Trees with the greedy continuation on some branches and noise on others (accepted paths of
    every length): the tokens of plain greedy decoding on the same engine, in float32 and in bf16
    (row-exact)."""
    t = load_packed(family_dirs[family], _format(dtype), dtype)
    tree = build_tree(WIDE_TREE)
    for seed, prompt in enumerate(prompts_for(t.tokenizer)[:2]):
        ids = t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = greedy_generate(t.model, ids, 40, [], engine="static").tokens
        oracle = OracleDrafter(tree, ref, t.config.vocab_size, seed)
        res = speculative_generate(t.model, oracle, ids, 40, [], engine="static")
        assert res.tokens == ref
        assert max(res.accepted) >= 3 and min(res.accepted) == 0, res.accepted


@pytest.mark.parametrize("family", ["qwen3", "smollm3", "mixtral"])
@torch.inference_mode()
def test_bf16_tree_rows_are_one_token_steps(family_dirs, family: str):
    """Each row of a bf16 tree step equals, bit for bit, the one-token step of its token after its
    ancestors: through the C++ loop's fused kernels (q/k norms, NoPE), or the Python loop's
        row-by-row MoE routing."""
    t = load_packed(family_dirs[family], _format("bfloat16"), "bfloat16")
    prompt, nodes = torch.arange(10, 50), torch.tensor([5, 6, 7, 8, 9, 10, 11])
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]])
    spec = StaticRunner(t.model, 64)
    spec.forward(prompt)
    rows, _ = spec.forward(nodes, tree)
    for leaf in (4, 5, 6):
        plain = StaticRunner(t.model, 64)
        plain.forward(prompt)
        for i in [i for i in range(tree.size) if tree.ancestors[leaf, i]]:
            logits, _ = plain.forward(nodes[i : i + 1])
            assert torch.equal(logits[0], rows[i]), (leaf, i)


@pytest.mark.parametrize(
    "family,dtype,fmt",
    [
        ("qwen3", "float64", "native"),
        ("qwen3", "bfloat16", BF16_FORMAT),
        ("smollm3", "float32", "native"),
    ],
)
@torch.inference_mode()
def test_the_cpp_loop_gives_the_python_loops_bits(family_dirs, family: str, dtype: str, fmt: str):
    """The C++ loop's q/k norms and NoPE layers: the Python loop's kernel calls in the same order
    (fused kernels off; those are the tree-row test's)."""
    if layer_loop.extension() is None:
        pytest.skip("the C++ extension does not build here")
    if fmt != "native" and kernels_missing(fmt, getattr(torch, dtype)):
        pytest.skip(kernels_missing(fmt, getattr(torch, dtype)))
    t = load_packed(family_dirs[family], fmt, dtype)
    python = StaticRunner(t.model, 64, loop="python")
    cpp = StaticRunner(t.model, 64, loop="cpp", fused_ops=False, prompt_attention="sdpa")
    assert python._loop is None and cpp._loop is not None
    assert all(torch.equal(x, y) for x, y in zip(engine_steps(python), engine_steps(cpp)))


def test_moe_is_refused_in_one_line_where_an_engine_does_not_run_it(family_dirs):
    """MoE layers: the C++ loop declines them (auto keeps the Python loop; cpp says why), and the
    compiled engine and the CUDA backend refuse them."""
    t = load64(family_dirs["mixtral"])
    assert StaticRunner(t.model, 32, loop="auto")._loop is None
    if layer_loop.extension() is not None:
        with pytest.raises(HeadwayError, match=r"target.layer_loop=cpp: .* \(MoE layers\)"):
            StaticRunner(t.model, 32, loop="cpp")
    with pytest.raises(HeadwayError, match="inference.engine=compiled does not run MoE layers"):
        StaticRunner(t.model, 32, compiled=True)
    with pytest.raises(HeadwayError, match="inference.engine=cuda does not run MoE layers"):
        CudaRunner(t.model, 32)
