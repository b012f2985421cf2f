"""DFlash: exact decoding from block drafts, a context cache that matches a fresh pass, training
blocks that see what inference sees, the loss against a slot-by-slot computation, training, export
and round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.export.exporter import export_head, load_export, read_export, serve_hint
from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.draft_layer import draft_layer_config
from headway.inference.drafters.dflash import DFlashDrafter
from headway.inference.drafters.hybrid import HybridConfig, HybridDrafter
from headway.inference.engines.tree import build_tree, chain_choices
from headway.inference.generate import features_at, greedy_generate, speculative_generate
from headway.kinds.registry import build_head
from headway.train.losses import draft_loss
from headway.train.objectives import Features
from headway.train.objectives.dflash import DFlashObjective, dflash_anchors
from tests.helpers.decode_helpers import chat_ids, float64_run, load64
from tests.helpers.train_helpers import losses, small_run

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


def random_head(t, seed: int = 0, **settings) -> DFlashHead:
    """An untrained DFlash head for target `t`, float64, with random weights."""
    torch.manual_seed(seed)
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    cfg = DFlashConfig(draft_vocab_size=96, block_size=5, **settings)
    cfg.feature_layers = DFlashHead.feature_layers(cfg, L)
    d2t = torch.sort(torch.randperm(V)[:96]).values
    heads = build_head(
        "dflash", cfg, h, V, d2t=d2t, layer_config=draft_layer_config(t.model.config, "llama")
    )
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    return heads.double().eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_untrained_dflash_heads_are_exact(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, num_layers=2)
    L = t.config.num_hidden_layers
    for choices in (chain_choices(4), [[0], [1], [0, 0], [0, 1], [0, 0, 0]], [[0]]):
        drafter = DFlashDrafter(heads, build_tree(choices), L)
        for text in ["What is two plus three?", "Write a short poem about the sea."]:
            ids = chat_ids(t, text)
            ref = greedy_generate(t.model, ids, 32, [t.tokenizer.eos_token_id])
            spec = speculative_generate(t.model, drafter, ids, 32, [t.tokenizer.eos_token_id])
            assert spec.tokens == ref.tokens, (arch, choices)
            assert max(spec.accepted) <= max(len(c) for c in choices)
    hybrid = HybridDrafter(
        DFlashDrafter(heads, build_tree(chain_choices(4)), L), HybridConfig(), lambda n, d: 1.0
    )
    ids = chat_ids(t, "Tell me a story about a fox.")
    ref = greedy_generate(t.model, ids, 40, [t.tokenizer.eos_token_id])
    assert (
        speculative_generate(t.model, hybrid, ids, 40, [t.tokenizer.eos_token_id]).tokens
        == ref.tokens
    )


def train_dflash(tiny_dirs, tiny_data, out: Path, *extra: str) -> Path:
    """A DFlash head (a block of 4) trained 12 small_run steps on the tiny Llama, with `extra`
    overrides (head.dflash.*); its head directory."""
    from headway.train.loop import train

    return train(
        small_run(
            tiny_dirs["llama"],
            tiny_data,
            out,
            "head.kind=dflash",
            *extra,
            "head.dflash.block_size=4",
            "train.max_steps=12",
        )
    )


def _fresh_context(t, heads: DFlashHead, tokens: list[int]):
    """The target's features for `tokens` and the head's context keys/values over them, in one
    pass."""
    with torch.no_grad():
        o = t.model(torch.tensor([tokens]), output_hidden_states=True)
        feats = features_at(o.hidden_states, heads.cfg.feature_layers, slice(None))
        return feats, heads.context(feats.unsqueeze(0), torch.arange(len(tokens)).unsqueeze(0))


def test_drafter_context_matches_the_accepted_text(tiny_dirs):
    """After decoding, the drafter's cached context equals one fresh pass over everything it was
    told: every verified position has the target's real feature, and no draft left anything
        behind."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t)
    drafter = DFlashDrafter(
        heads, build_tree([[0], [1], [0, 0], [0, 0, 0]]), t.config.num_hidden_layers
    )
    told: list[int] = []
    begin, accept = drafter.begin, drafter.accept
    drafter.begin = lambda prompt, root, f: (told.extend(prompt + [root]), begin(prompt, root, f))
    drafter.accept = lambda tokens, f: (told.extend(tokens), accept(tokens, f))
    speculative_generate(t.model, drafter, chat_ids(t, "Tell me a story about a fox."), 40, [])
    _, fresh = _fresh_context(t, heads, told[:-1])
    assert drafter.length == len(told) - 1
    for (k, v), (fk, fv) in zip(drafter.context, fresh):
        torch.testing.assert_close(k, fk, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v, fv, rtol=1e-9, atol=1e-9)


def test_training_blocks_see_what_inference_sees(tiny_dirs):
    """The objective's blocks, all anchors of a sequence in one masked forward, give each block the
    logits the drafter computes for it alone after the context before its anchor."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, num_layers=2)
    ids = chat_ids(t, "Write a short poem about the sea and the sky, please.")
    T = len(ids)
    feats, context = _fresh_context(t, heads, ids)
    batch = {"input_ids": torch.tensor([ids]), "loss_mask": torch.ones(1, T, dtype=torch.long)}
    anchors, ok = dflash_anchors(batch, 6, heads.cfg.block_size, seed=0)
    bs, A = heads.cfg.block_size, anchors.shape[1]
    tokens = torch.full((1, A, bs), heads.mask_token_id)
    tokens[..., 0] = torch.tensor(ids)[anchors]
    pos = anchors.unsqueeze(-1) + torch.arange(bs)
    ctx_ok = torch.arange(T).view(1, 1, T) < anchors.view(1, A, 1)
    same = torch.eye(A, dtype=torch.bool).repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    allowed = torch.cat((ctx_ok.repeat_interleave(bs, 1), same.unsqueeze(0)), dim=2)
    with torch.no_grad():
        batched = heads.block(tokens.view(1, -1), pos.view(1, -1), context, allowed).view(A, bs, -1)
        for i, a in enumerate(anchors[0].tolist()):
            assert ok[0, i]
            alone = heads.draft_logits([(k[:, :, :a], v[:, :, :a]) for k, v in context], ids[a], a)
            torch.testing.assert_close(batched[i, 1:], alone, rtol=1e-9, atol=1e-9)


def test_dflash_loss_is_the_weighted_sum_of_its_slots(tiny_dirs):
    """The objective equals its definition computed slot by slot: for each anchor a and slot j, the
    block's logits against the target's distribution at a + j - 1, averaged per slot and
    weighted exp(-(j-1)/gamma)."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, loss_gamma=2.0)
    ids = chat_ids(t, "What is two plus three? Tell me a story.")
    T = len(ids)
    with torch.no_grad():
        o = t.model(torch.tensor([ids]), output_hidden_states=True)
    hidden = dict(enumerate(o.hidden_states))
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, T // 3 :] = 1  # the answer: only its tokens are learned
    batch = {
        "input_ids": torch.tensor([ids]),
        "loss_mask": mask,
        "attention_mask": torch.ones(1, T),
    }
    seed = 3  # train.seed: the anchors are drawn with it
    with torch.no_grad():
        total, metrics = DFlashObjective(heads.cfg, seed=seed)(
            heads, batch, Features(hidden, o.logits), None
        )
        anchors, ok = dflash_anchors(batch, heads.cfg.anchors, heads.cfg.block_size, seed)
        feats = torch.cat([hidden[i][0] for i in heads.cfg.feature_layers], -1)
        context = heads.context(feats.unsqueeze(0), torch.arange(T).unsqueeze(0))
        target_p = torch.softmax(o.logits[0][:, heads.d2t].float(), -1)
        expected = 0.0
        for j in range(1, heads.cfg.block_size):
            rows, want = [], []
            for a in anchors[0][ok[0]].tolist():
                if a + j < T and mask[0, a + j]:
                    logits = heads.draft_logits(
                        [(k[:, :, :a], v[:, :, :a]) for k, v in context], ids[a], a
                    )
                    rows.append(logits[j - 1].float())
                    want.append(target_p[a + j - 1])
            if rows:
                expected += math.exp(-(j - 1) / 2.0) * float(
                    draft_loss("soft_ce", torch.stack(rows), torch.stack(want))
                )
    # float32 losses, batched against one by one
    assert float(total) == pytest.approx(expected, rel=1e-6)
    assert 1.0 <= metrics["tau/chain"] <= heads.cfg.block_size
    # anchors precede answer tokens
    assert all(bool(mask[0, a + 1]) for a in anchors[0][ok[0]].tolist())


def test_dflash_settings_are_checked():
    with pytest.raises(HeadwayError, match="head.dflash: block_size must be >= 2"):
        DFlashConfig(block_size=1)
    with pytest.raises(HeadwayError, match="head.dflash.feature_layers"):
        DFlashConfig(feature_layers=[3, 1, 2])
    with pytest.raises(HeadwayError, match="head.dflash.loss"):
        DFlashConfig(loss="mse")
    with pytest.raises(HeadwayError, match="head.dflash.lm_head"):
        DFlashConfig(lm_head="shared")


def test_trained_dflash_head_learns_decodes_exactly_exports_and_round_trips(
    tiny_dirs, tiny_data, tmp_path: Path
):
    from headway.inference.api import SpeculativeDecoder

    head_dir = train_dflash(
        tiny_dirs, tiny_data, tmp_path / "run", "head.dflash.draft_vocab_size=64"
    )
    curve = losses(tmp_path / "run")
    assert curve[-1][1] < curve[0][1]  # it learns
    config = json.loads((head_dir / "config.json").read_text())
    assert config["kind"] == "dflash" and config["head"]["feature_layers"] == [1, 2, 3]
    cfg = float64_run(tiny_dirs["llama"])
    for drafter in ("neural", "hybrid"):
        decoder = SpeculativeDecoder.load(head_dir, cfg).with_drafter(drafter)
        result = decoder.chat("Question 3: what is 3 plus 4?", 24)
        assert result.spec.tokens == result.plain.tokens
    assert decoder.drafter.neural.tree.max_depth == 3  # the whole block's chain by default

    out = export_head(head_dir, "vllm", tmp_path / "vllm")
    fmt, engine_cfg, tensors = read_export(out)
    assert (
        engine_cfg["architectures"] == ["DFlashDraftModel"] and engine_cfg["model_type"] == "qwen3"
    )
    assert engine_cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # 0-based decoder layers
    assert engine_cfg["dflash_config"]["mask_token_id"] == config["vocab_size"] - 1
    assert "causal" not in engine_cfg["dflash_config"]  # bidirectional within the block, as trained
    assert engine_cfg["num_hidden_layers"] == 1 and engine_cfg["draft_vocab_size"] == 64
    h = config["hidden_size"]
    assert tensors["fc.weight"].shape == (h, 3 * h) and tensors["lm_head.weight"].shape == (64, h)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight", "d2t"} <= set(
        tensors
    )
    assert not any(
        k.startswith(("embed_tokens", "model.")) for k in tensors
    )  # the target's embedding is shared
    back, original = load_export(out).state_dict(), load_export(head_dir).state_dict()
    assert set(back) == set(original)
    for k, v in original.items():  # the export holds bf16 weights; ids are exact
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(back[k].to(want.dtype), want), k
    assert '"method": "dflash"' in serve_hint(
        "vllm", engine_cfg, out
    ) and '"num_speculative_tokens": 3' in serve_hint("vllm", engine_cfg, out)
    with pytest.raises(
        HeadwayError,
        match="silently drops a draft's lm_head and d2t.*--format vllm, or train a head for SGLang with "
        "head.dflash.lm_head=target",
    ):
        export_head(head_dir, "sglang", tmp_path / "sglang")


def test_dflash_reading_out_through_the_target_lm_head(tiny_dirs, tiny_data, tmp_path: Path):
    """lm_head=target: the head drafts over the whole vocabulary through the target's frozen
    lm_head, saves neither, decodes exactly, and exports for SGLang and vLLM with no lm_head or d2t
    (both engines then read out through the target's), round-tripping."""
    from headway.inference.api import SpeculativeDecoder

    t = load64(tiny_dirs["qwen2"])
    heads = random_head(t, lm_head="target")
    assert heads.lm_head is None and heads.draft_vocab_size == t.config.vocab_size
    assert "lm_head.weight" not in heads.state_dict() and "d2t" not in heads.state_dict()
    x = torch.randn(3, t.config.hidden_size, dtype=torch.float64)
    assert torch.equal(heads.read_out(x), x @ t.model.get_output_embeddings().weight.T)
    drafter = DFlashDrafter(heads, build_tree(chain_choices(4)), t.config.num_hidden_layers)
    ids = chat_ids(t, "What is two plus three?")
    ref = greedy_generate(t.model, ids, 32, [t.tokenizer.eos_token_id])
    assert (
        speculative_generate(t.model, drafter, ids, 32, [t.tokenizer.eos_token_id]).tokens
        == ref.tokens
    )

    head_dir = train_dflash(tiny_dirs, tiny_data, tmp_path / "run", "head.dflash.lm_head=target")
    curve = losses(tmp_path / "run")
    assert curve[-1][1] < curve[0][1]  # it learns through the frozen read-out
    config = json.loads((head_dir / "config.json").read_text())
    assert (
        config["head"]["lm_head"] == "target" and config["draft_vocab_size"] == config["vocab_size"]
    )
    cfg = float64_run(tiny_dirs["llama"])
    decoder = SpeculativeDecoder.load(head_dir, cfg).with_drafter("neural")
    result = decoder.chat("Question 3: what is 3 plus 4?", 24)
    assert result.spec.tokens == result.plain.tokens

    native = load_export(head_dir).state_dict()
    for fmt in ("sglang", "vllm"):
        out = export_head(head_dir, fmt, tmp_path / fmt)
        _, engine_cfg, tensors = read_export(out)
        assert engine_cfg["architectures"] == ["DFlashDraftModel"]
        # both engines then take the target's vocabulary
        assert "draft_vocab_size" not in engine_cfg
        assert not {"lm_head.weight", "d2t", "t2d"} & set(tensors)
        assert engine_cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
        assert engine_cfg["block_size"] == 4
        back = load_export(out)
        assert back.cfg.lm_head == "target" and set(back.state_dict()) == set(native)
    # vLLM's export: its own keys only
    assert engine_cfg["dflash_config"].get("num_target_layers") is None
    _, sglang_cfg, _ = read_export(tmp_path / "sglang")
    assert (
        sglang_cfg["dflash_config"]["num_target_layers"]
        == config["target_fingerprint"]["num_hidden_layers"]
    )
    hint = serve_hint("sglang", sglang_cfg, tmp_path / "sglang")
    assert "--speculative-algorithm DFLASH" in hint and "--speculative-num-draft-tokens 4" in hint
