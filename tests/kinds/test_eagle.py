"""EAGLE-1 and EAGLE-3: exact decoding over dynamic trees, a drafter cache that matches the accepted
text, training-time test with the inference-time attention, training and round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import draft_layer_config, drafter_mask
from headway.heads.eagle import EagleConfig
from headway.heads.eagle3 import Eagle3Config, Eagle3Head
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.generate import features_at, greedy_generate, speculative_generate
from headway.kinds.checkpoint import load_head
from headway.kinds.registry import build_head
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from headway.train.ttt import ttt_unroll
from tests.helpers.decode_helpers import chat_ids, float64_run, load64
from tests.helpers.train_helpers import losses, small_run

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


def random_head(t, kind: str, seed: int = 0, draft_layer: str = "target"):
    """An untrained head of `kind` for target `t`, float64, with random (not zero) weights; its
    draft layer is the target's own class unless draft_layer=llama."""
    torch.manual_seed(seed)
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    if kind == "eagle3":
        cfg = Eagle3Config(draft_vocab_size=96, ttt_steps=3, draft_layer=draft_layer)
        cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
        d2t = torch.sort(torch.randperm(V)[:96]).values
    else:
        cfg, d2t = EagleConfig(draft_layer=draft_layer), None
    heads = build_head(
        kind, cfg, h, V, d2t=d2t, layer_config=draft_layer_config(t.model.config, draft_layer)
    )
    heads.init_from_target(t.model)
    heads.attach_target(t.model)
    return heads.double().eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_untrained_eagle_heads_are_exact(tiny_dirs, arch: str, kind: str):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, kind)
    for depth, top_k, total in [(4, 3, 10), (1, 1, 1), (6, 5, 40)]:
        drafter = EagleDrafter(heads, t.config.num_hidden_layers, depth, top_k, total)
        for text in ["What is two plus three?", "Write a short poem about the sea."]:
            ids = chat_ids(t, text)
            ref = greedy_generate(t.model, ids, 32, [t.tokenizer.eos_token_id])
            spec = speculative_generate(t.model, drafter, ids, 32, [t.tokenizer.eos_token_id])
            assert spec.tokens == ref.tokens, (arch, kind, depth, top_k, total)
            assert max(spec.accepted) <= depth


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_drafter_cache_matches_the_accepted_text(tiny_dirs, kind: str):
    """After decoding, the drafter's state equals one fresh causal pass over everything it was told:
    the tree expansions left nothing behind and every accepted position has the target's real
    feature."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, kind)
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, 4, 4, 12)
    told: list[int] = []
    begin, accept = drafter.begin, drafter.accept
    drafter.begin = lambda prompt, root, f: (told.extend(prompt + [root]), begin(prompt, root, f))
    drafter.accept = lambda tokens, f: (told.extend(tokens), accept(tokens, f))
    ids = chat_ids(t, "Tell me a story about a fox.")
    speculative_generate(t.model, drafter, ids, 40, [])
    with torch.no_grad():
        o = t.model(torch.tensor([told[:-1]]), output_hidden_states=True)
        feats = features_at(o.hidden_states, drafter.feature_layers, slice(None))
        n = len(told) - 1
        mask = drafter_mask(torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0), torch.float64)
        fresh = heads(
            torch.tensor([told[1:]]),
            heads.project(feats.unsqueeze(0)),
            torch.arange(n).unsqueeze(0),
            mask,
        )
    assert drafter.committed == n
    torch.testing.assert_close(drafter.last_out, fresh[0, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_drafter_cache_drafts_what_transformers_cache_drafts(
    tiny_dirs, arch: str, kind: str
):
    """The drafter layer's preallocated cache (llama-style families; others keep transformers'
    cache) proposes the same candidates with the same scores at every step as transformers'
    DynamicCache, through growth past its first buffer and the truncation after every expansion."""
    from headway.inference.engines.static.runner import StaticLayerCache

    t = load64(tiny_dirs[arch])
    heads = random_head(t, kind)
    runs = {}
    for static in (True, False):
        drafter = EagleDrafter(heads, t.config.num_hidden_layers, 3, 3, 8, static=static)
        # a small first buffer: the prompt and the expansions must grow it
        if static and arch != "gemma3":
            drafter._new_cache = lambda: StaticLayerCache(heads.decoder, capacity=8)
        seen: list = []
        draft = drafter.draft
        drafter.draft = lambda root: (seen.append(drafter.candidates()), draft(root))[1]
        ids = chat_ids(t, "Tell me a story about a fox and a crow.")
        out = speculative_generate(t.model, drafter, ids, 48, [])
        runs[static] = (out.tokens, seen)
        assert isinstance(EagleDrafter._new_cache(drafter), StaticLayerCache) == (
            static and arch != "gemma3"
        )
    assert runs[True][0] == runs[False][0]
    assert len(runs[True][1]) == len(runs[False][1])
    for (tok_s, sc_s, par_s, _), (tok_d, sc_d, par_d, _) in zip(runs[True][1], runs[False][1]):
        assert (tok_s, par_s) == (tok_d, par_d)
        torch.testing.assert_close(torch.tensor(sc_s), torch.tensor(sc_d), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_layer_in_the_cpp_loop_runs_as_the_python_step(tiny_dirs, arch: str):
    """The EAGLE-3 draft layer as one C++ layer-loop call gives the Python step's bits (float64),
    and with the fused bf16 kernels stays within bf16 rounding of it, over a prompt and a tree
    expansion after it."""
    from headway.inference.engines.static.runner import StaticLayerCache

    t = load64(tiny_dirs[arch])
    h = t.config.hidden_size
    outs = {}
    for dtype in (torch.float64, torch.bfloat16):
        heads = random_head(t, "eagle3").to(dtype)
        torch.manual_seed(3)
        prompt, hidden = (
            torch.randint(0, 96, (1, 6)),
            torch.randn(1, 6, h, dtype=torch.float64).to(dtype),
        )
        tree, tree_hidden = (
            torch.randint(0, 96, (1, 3)),
            torch.randn(1, 3, h, dtype=torch.float64).to(dtype),
        )
        causal = torch.ones(6, 6, dtype=torch.bool).tril().unsqueeze(0)
        # three rows at position 6, each seeing the prompt and itself
        allowed = torch.cat(
            [torch.ones(1, 3, 6, dtype=torch.bool), torch.eye(3, dtype=torch.bool)[None]], -1
        )
        for path in ("python", "cpp"):
            cache = StaticLayerCache(heads.decoder, capacity=4)  # the prompt grows it
            if cache.loop is None:
                pytest.skip("the C++ layer loop does not build here")
            if path == "python":
                cache.loop = None
            with torch.no_grad():
                first = heads(
                    heads.d2t[prompt],
                    hidden,
                    torch.arange(6)[None],
                    drafter_mask(causal, dtype),
                    cache,
                )
                second = heads(
                    heads.d2t[tree],
                    tree_hidden,
                    torch.full((1, 3), 6),
                    drafter_mask(allowed, dtype),
                    cache,
                )
            outs[dtype, path] = torch.cat([first, second], 1)
    assert torch.equal(outs[torch.float64, "cpp"], outs[torch.float64, "python"])
    ref = outs[torch.float64, "python"]
    python_error = (outs[torch.bfloat16, "python"].double() - ref).abs().max()
    fused_error = (outs[torch.bfloat16, "cpp"].double() - ref).abs().max()
    assert fused_error <= 2 * python_error + 1e-2 * ref.abs().max()


def test_training_time_test_sees_what_inference_sees(tiny_dirs):
    """Step j of the unrolled drafter at position t equals drafting a chain j steps past t at
    inference, and depends on nothing later: tokens up to t+1+j and features up to t."""
    from transformers import DynamicCache

    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    torch.manual_seed(1)
    T, steps = 12, 3
    ids = torch.randint(0, t.config.vocab_size, (1, T))
    attn = torch.ones(1, T, dtype=torch.long)
    feats = torch.randn(1, T, 3 * t.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        outs = ttt_unroll(heads, ids, attn, heads.project(feats), steps).outputs
        for pos in (
            0,
            4,
            7,
        ):  # inference: commit 0..pos with real features, then extend a chain of true tokens
            cache = DynamicCache(config=heads.decoder.config)
            n = pos + 1
            causal = drafter_mask(
                torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0), torch.float64
            )
            out = heads(
                ids[:, 1 : n + 1],
                heads.project(feats[:, :n]),
                torch.arange(n).unsqueeze(0),
                causal,
                cache,
            )
            hidden = out[:, -1:]
            torch.testing.assert_close(hidden[0, 0], outs[0][0, pos])
            for j in range(1, steps):
                mask = drafter_mask(torch.ones(1, 1, n + j, dtype=torch.bool), torch.float64)
                out = heads(
                    ids[:, pos + 1 + j : pos + 2 + j],
                    hidden,
                    torch.tensor([[pos + j]]),
                    mask,
                    cache,
                )
                torch.testing.assert_close(out[0, 0], outs[j][0, pos])
                hidden = out
        later_ids, later_feats = ids.clone(), feats.clone()
        later_ids[0, 9] = (later_ids[0, 9] + 1) % t.config.vocab_size
        later_feats[0, 9] += 1.0
        moved_ids = ttt_unroll(heads, later_ids, attn, heads.project(feats), steps).outputs
        moved_feats = ttt_unroll(heads, ids, attn, heads.project(later_feats), steps).outputs
    for j in range(steps):
        torch.testing.assert_close(
            moved_ids[j][0, : 9 - 1 - j], outs[j][0, : 9 - 1 - j]
        )  # tokens <= t+1+j < 9
        # reads token 9 at t = 8 - j
        assert not torch.allclose(moved_ids[j][0, 8 - j], outs[j][0, 8 - j])
        torch.testing.assert_close(moved_feats[j][0, :9], outs[j][0, :9])  # features <= t < 9


def test_eagle_tree_settings_are_checked(tiny_dirs):
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    with pytest.raises(HeadwayError, match="depth, top_k and total_tokens >= 1"):
        EagleDrafter(heads, t.config.num_hidden_layers, 0, 4, 8)
    with pytest.raises(HeadwayError, match="top_k=500 exceeds the head's draft vocabulary"):
        EagleDrafter(heads, t.config.num_hidden_layers, 3, 500, 8)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_trained_eagle_head_learns_round_trips_and_decodes_exactly(
    tiny_dirs, tiny_data, tmp_path: Path, kind: str
):
    from headway.inference.api import SpeculativeDecoder
    from headway.train.loop import train

    head_dir = train(
        small_run(
            tiny_dirs["llama"],
            tiny_data,
            tmp_path / "run",
            f"head.kind={kind}",
            "head.eagle3.draft_vocab_size=64",
            "head.eagle3.ttt_steps=3",
            "train.max_steps=12",
        )
    )
    curve = losses(tmp_path / "run")
    assert curve[-1][1] < curve[0][1]  # it learns
    config = json.loads((head_dir / "config.json").read_text())
    assert config["kind"] == kind and config["draft_layer"]["num_hidden_layers"] == 1
    if kind == "eagle3":
        assert config["head"]["feature_layers"] == [
            1,
            2,
            3,
        ]  # (2, L//2, L-3) does not ascend on 4 layers: (1, L//2, L-1)
        assert config["draft_vocab_size"] == 64
    cfg = float64_run(tiny_dirs["llama"], "inference.max_new_tokens=24")
    decoder = SpeculativeDecoder.load(head_dir, cfg)
    decoder.warm_up()
    # the warm-up decoded through a throwaway copy of the hybrid
    assert not decoder.drafter.calibration.rates
    result = decoder.chat("Question 3: what is 3 plus 4?")
    assert result.spec.tokens == result.plain.tokens
    assert result.spec.tau > 1.0  # the tiny target repeats itself; a trained drafter sees it
    other = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["qwen2"]), device="cpu"), with_model=False
    )
    with pytest.raises(HeadwayError, match="was made for target"):
        load_head(head_dir, other.fingerprint)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "dflash"])
def test_offline_features_give_the_online_loss(tiny_dirs, tiny_data, tmp_path: Path, kind: str):
    """Features cached once (float32) give the same loss on the same batch as running the target."""
    import subprocess
    import sys

    from headway.train.loop import train

    extra = (
        f"head.kind={kind}",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "head.dflash.draft_vocab_size=64",
        "head.medusa.num_heads=2",
        "head.eagle.feature_noise=0",
        "train.max_steps=3",
        "train.eval_every=0",
        "train.save_every=0",
    )
    feats = tmp_path / "feats"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "headway",
            "cache-features",
            f"target.name_or_path={tiny_dirs['llama']}",
            "target.num_threads=1",
            f"train.datasets=[{tiny_data}]",
            f"features.output_dir={feats}",
            "features.dtype=float32",
            "features.shard_size=10",
            "features.layers=[1,2,3,4]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "GB on disk" in res.stdout and len(list((feats / "shards").glob("*.safetensors"))) == 3
    train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "online", *extra))
    train(
        small_run(
            tiny_dirs["llama"],
            tiny_data,
            tmp_path / "offline",
            *extra,
            f"train.features_dir=[{feats}]",
        )
    )
    online, offline = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert [s for s, _ in online] == [1, 2, 3]
    for (_, a), (_, b) in zip(online, offline):
        assert b == pytest.approx(a, rel=1e-5)
    with pytest.raises(
        HeadwayError, match=r"cached with max_length=1024, but training has train.max_length=64"
    ):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "x",
                *extra,
                f"train.features_dir=[{feats}]",
                "train.max_length=64",
            )
        )
    shard = sorted((feats / "shards").glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-8])  # a damaged shard is named, not read
    with pytest.raises(HeadwayError, match=rf"feature shard .*{shard.name} is missing or damaged"):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "again",
                *extra,
                f"train.features_dir=[{feats}]",
            )
        )


def test_features_from_several_caches(tiny_dirs, tiny_data, tmp_path: Path):
    """Data cached in groups (one cache per dataset) trains as one cache would; a dataset no cache
    holds is named."""
    import shutil

    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.train.feature_cache import run_cache_features
    from headway.train.loop import train

    second = tmp_path / "second"
    shutil.copytree(tiny_data, second)
    caches = []
    for i, ds in enumerate([tiny_data, second]):
        caches.append(tmp_path / f"feats{i}")
        c = load_config(
            RunConfig,
            None,
            [
                f"target.name_or_path={tiny_dirs['llama']}",
                "target.num_threads=1",
                f"train.datasets=[{ds}]",
                f"features.output_dir={caches[-1]}",
                "features.dtype=float32",
                "features.layers=[1,2,3,4]",
            ],
        )
        run_cache_features(c.target, c.head, c.features, c.train.datasets, c.train.max_length)
    extra = (
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "train.max_steps=3",
        "train.eval_every=0",
        "train.save_every=0",
        f"train.datasets=[{tiny_data},{second}]",
    )
    train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "online", *extra))
    train(
        small_run(
            tiny_dirs["llama"],
            tiny_data,
            tmp_path / "offline",
            *extra,
            f"train.features_dir=[{caches[0]},{caches[1]}]",
        )
    )
    for (_, a), (_, b) in zip(losses(tmp_path / "online"), losses(tmp_path / "offline")):
        assert b == pytest.approx(a, rel=1e-5)
    with pytest.raises(HeadwayError, match=rf"not from \['{second}'\]"):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "x",
                *extra,
                f"train.features_dir=[{caches[0]}]",
            )
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle31_heads_are_exact(tiny_dirs, arch: str):
    """EAGLE-3.1's norms (input norms before fc, the normed output fed back) draft through the same
    tree code: greedy output equals plain decoding, float64, on each architecture, with the norms'
    weights random."""
    t = load64(tiny_dirs[arch])
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    for input_norm, norm_output in (("per_layer", True), ("concat", False)):
        torch.manual_seed(0)
        cfg = Eagle3Config(
            draft_vocab_size=96, ttt_steps=3, input_norm=input_norm, norm_output=norm_output
        )
        cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
        d2t = torch.sort(torch.randperm(V)[:96]).values
        heads = build_head(
            "eagle3", cfg, h, V, d2t=d2t, layer_config=draft_layer_config(t.model.config, "target")
        )
        heads.init_from_target(t.model)
        heads.attach_target(t.model)
        heads = heads.double().eval()
        with torch.no_grad():
            for name, p in heads.named_parameters():
                if "fc_norm" in name or "input_norm." in name:
                    p.mul_(1 + 0.5 * torch.randn_like(p))
        drafter = EagleDrafter(heads, L, 4, 3, 10)
        for text in ["What is two plus three?", "Write a short poem about the sea."]:
            ids = chat_ids(t, text)
            ref = greedy_generate(t.model, ids, 32, [t.tokenizer.eos_token_id])
            spec = speculative_generate(t.model, drafter, ids, 32, [t.tokenizer.eos_token_id])
            assert spec.tokens == ref.tokens, (arch, input_norm, norm_output)


def test_an_eagle3_head_continues_as_eagle31_from_its_weights(
    tiny_dirs, tiny_data, tmp_path: Path, caplog
):
    """train.init_from a plain EAGLE-3 head with EAGLE-3.1's norms turned on: every weight starts as
    the head's, the added norms at ones; it trains, resumes, and its directory records the norms."""
    from headway.train.loop import train
    from headway.train.setup_heads import heads_from

    base = [
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "train.max_steps=3",
    ]
    first = train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "plain", *base))
    more = [
        *base,
        f"train.init_from={first}",
        "head.eagle3.input_norm=per_layer",
        "head.eagle3.norm_output=true",
    ]
    cfg = small_run(tiny_dirs["llama"], tiny_data, tmp_path / "v31", *more)
    target = load_target(cfg.target)
    with caplog.at_level("INFO", logger="headway"):
        grown = heads_from(cfg.head, cfg.train.init_from, target)
    assert (
        "head.eagle3.input_norm, head.eagle3.norm_output start at their initial weights"
        in caplog.text
    )
    old = load_head(first, target.fingerprint)
    for k, v in old.state_dict().items():
        assert torch.equal(grown.state_dict()[k], v), k
    assert all(
        bool((p == 1).all()) for n, p in grown.named_parameters() if n.startswith("fc_norm.")
    )
    head = train(cfg)
    assert json.loads((head / "config.json").read_text())["head"]["input_norm"] == "per_layer"
    assert all(v == v for _, v in losses(tmp_path / "v31"))  # finite
    steps = [s for s, _ in losses(tmp_path / "v31")]
    train(cfg)  # rerun: resumes at its last checkpoint, logs no step twice
    assert [s for s, _ in losses(tmp_path / "v31")] == steps
    smaller = small_run(
        tiny_dirs["llama"], tiny_data, tmp_path / "x", *more, "head.eagle3.draft_vocab_size=32"
    )
    # a shape-defining change is still refused
    with pytest.raises(HeadwayError, match="draft_vocab_size=64"):
        heads_from(smaller.head, smaller.train.init_from, target)
