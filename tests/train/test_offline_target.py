"""Training from cached features (train.features_dir) loads the target's embedding, final norm and
lm_head only (target/partial.py), bit for bit those of the whole model, and trains the same curve; a
whole target loads onto its device in one step (target/loading.py's staged_placement). GPU review,
training, finding 14."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.target.config import TargetConfig
from headway.target.loading import load_target, staged_placement
from headway.target.partial import PartialCausalLM, held_bytes, load_partial_target
from tests.helpers.tiny_models import make_config, make_tokenizer
from tests.helpers.train_helpers import losses, small_run


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def untied_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with its own lm_head (untied embeddings), saved whole and in shards (an index
    json naming each tensor's file)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("untied")
    tokenizer = make_tokenizer("llama")
    config = make_config("llama", (len(tokenizer) + 16) // 16 * 16, tokenizer)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = {}
    for name, shard in (("untied", None), ("sharded", "40KB")):
        out[name] = root / name
        model.save_pretrained(out[name], **({"max_shard_size": shard} if shard else {}))
        tokenizer.save_pretrained(out[name])
    assert (out["sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(out["sharded"].glob("*.safetensors"))) > 2
    return out


def _model_dir(which: str, tiny_dirs: dict, untied_dirs: dict) -> Path:
    return untied_dirs[which] if which in untied_dirs else tiny_dirs[which]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["llama", "gemma3", "untied", "sharded"])
def test_the_partial_target_holds_the_whole_models_embedding_norm_and_lm_head_bit_for_bit(
    tiny_dirs, untied_dirs, which: str, dtype: str
):
    """Tied (llama, gemma3: a scaled embedding and a (1 + w) norm) and untied (whole and sharded
    checkpoints), in float32 and bfloat16: the same tensors, buffers, config and fingerprint as the
    whole model's, the same embedding and logits computed; and nothing else held."""
    from headway.train.objectives.common import target_logits

    cfg = TargetConfig(
        name_or_path=str(_model_dir(which, tiny_dirs, untied_dirs)),
        device="cpu",
        dtype=dtype,
        num_threads=1,
    )
    whole, part = load_target(cfg), load_partial_target(cfg)
    full, model = whole.model, part.model
    assert isinstance(model, PartialCausalLM)
    pairs = {
        "embedding": (full.get_input_embeddings(), model.get_input_embeddings()),
        "norm": (full.model.norm, model.model.norm),
        "lm_head": (full.get_output_embeddings(), model.get_output_embeddings()),
    }
    for name, (a, b) in pairs.items():
        assert type(a) is type(b), name
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), (name, key)
        assert {n: t.dtype for n, t in a.named_buffers()} == {
            n: t.dtype for n, t in b.named_buffers()
        }, name
    tied = full.get_output_embeddings().weight is full.get_input_embeddings().weight
    assert tied == (which in ("llama", "gemma3"))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert part.fingerprint == whole.fingerprint
    assert model.config.to_dict() == full.config.to_dict()
    assert part.device == whole.device == torch.device("cpu")
    ids = torch.tensor([[3, 17, 42, 99]])
    assert torch.equal(model.get_input_embeddings()(ids), full.get_input_embeddings()(ids))
    hidden = torch.randn(1, 4, int(full.config.hidden_size))
    assert torch.equal(target_logits(model, hidden), target_logits(full, hidden))
    # the bytes a rank holds: the embedding and the norm, and an untied lm_head, nothing more
    expected = sum(
        t.numel() * t.element_size()
        for t in {id(p): p for m, _ in pairs.values() for p in m.parameters()}.values()
    )
    assert held_bytes(model) == expected + sum(
        b.numel() * b.element_size() for b in full.get_input_embeddings().buffers()
    )
    assert held_bytes(model) < 0.6 * held_bytes(full)
    with pytest.raises(HeadwayError, match="cannot run"):
        model(input_ids=ids)


def test_a_target_layer_a_head_copies_is_loaded_too(tiny_dirs):
    """EAGLE-3's head.eagle3.init_layer copies a target layer: that layer alone is real, the others
    are placeholders (the layer count stays the target's)."""
    cfg = TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    full = load_target(cfg).model
    model = load_partial_target(cfg, layers=lambda config: [2]).model
    layers = model.get_decoder().layers
    assert len(layers) == full.config.num_hidden_layers
    assert type(layers[2]) is type(full.model.layers[2])
    want, got = full.model.layers[2].state_dict(), layers[2].state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(isinstance(layers[i], torch.nn.Identity) for i in (0, 1, 3))


def test_a_checkpoint_naming_other_tensors_loads_the_whole_target(tiny_dirs, monkeypatch, caplog):
    from headway.target import partial

    monkeypatch.setattr(partial, "checkpoint_files", lambda path: {})
    cfg = TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    with caplog.at_level("WARNING", logger="headway"):
        target = load_partial_target(cfg)
    assert not isinstance(target.model, PartialCausalLM)
    assert "loading the whole target" in caplog.text


@pytest.fixture(scope="module")
def feats(tiny_dirs, tiny_data, tmp_path_factory) -> Path:
    """The tiny Llama's features over tiny_data, cached in float32."""
    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.train.feature_cache import run_cache_features

    out = tmp_path_factory.mktemp("feats") / "cache"
    c = load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={tiny_dirs['llama']}",
            "target.num_threads=1",
            f"train.datasets=[{tiny_data}]",
            f"features.output_dir={out}",
            "features.dtype=float32",
            "features.layers=[1,2,3,4]",
        ],
    )
    run_cache_features(c.target, c.head, c.features, c.train.datasets, c.train.max_length)
    return out


KINDS = {
    "medusa": ("head.kind=medusa", "head.medusa.num_heads=2"),
    "eagle": ("head.kind=eagle", "head.eagle.feature_noise=0"),
    "eagle3": ("head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=2"),
    "eagle3_init_layer": (
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "head.eagle3.draft_layer=target",
        "head.eagle3.init_layer=1",
    ),
    "dflash": ("head.kind=dflash", "head.dflash.draft_vocab_size=64"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_offline_training_loads_no_decoder_layer_and_trains_the_same_curve(
    tiny_dirs, tiny_data, feats, tmp_path, monkeypatch, kind: str
):
    """With train.features_dir the run's target holds the embedding, final norm and lm_head only
    (the whole model is never built: from_pretrained fails here), and the run gives the losses, to
    the bit, of the same offline run on the whole target; Medusa's per-rank accuracy, measured on
    the held-out sequences' cached features, matches the one the whole target measures."""
    import transformers

    from headway.train import loop

    extra = (
        *KINDS[kind],
        "train.max_steps=3",
        "train.save_every=0",
        "train.eval_every=3",
        f"train.features_dir=[{feats}]",
    )
    full = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu")).model
    embed, norm = full.get_input_embeddings().weight, full.model.norm.weight
    layer = sum(p.numel() * 4 for p in full.model.layers[1].parameters())
    held: dict[str, int] = {}
    setup_target = loop.setup_target

    def recorded(run):
        target = setup_target(run)
        held[run.out.name] = held_bytes(target.model)
        return target

    monkeypatch.setattr(loop, "setup_target", recorded)
    with monkeypatch.context() as m:  # the run as it was: the whole target, offline
        m.setattr(
            loop, "load_partial_target", lambda cfg, layers=(): load_target(cfg), raising=False
        )
        loop.train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "whole", *extra))

    def refused(*args, **kwargs):
        raise AssertionError("offline training built the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refused)
    loop.train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "partial", *extra))
    whole, partial = losses(tmp_path / "whole"), losses(tmp_path / "partial")
    assert [s for s, _ in whole] == [1, 2, 3] and partial == whole

    assert held["whole"] == held_bytes(full)
    assert held["partial"] == (embed.numel() + norm.numel()) * 4 + (
        layer if kind == "eagle3_init_layer" else 0
    )
    head = {
        run: json.loads((tmp_path / run / "head" / "config.json").read_text())
        for run in ("whole", "partial")
    }
    if kind == "medusa":
        torch.testing.assert_close(
            torch.tensor(head["partial"]["rank_accuracy"]),
            torch.tensor(head["whole"]["rank_accuracy"]),
            rtol=0,
            atol=1e-6,
        )
    shutil.rmtree(tmp_path / "whole")


def test_a_whole_target_loads_onto_its_device_in_one_step(tiny_dirs, monkeypatch):
    """Online training's target: on the CPU it loads as before (no device_map) and ends on the CPU
    with the checkpoint's weights; on a CUDA device from_pretrained gets device_map={"": device}
    (each tensor read straight onto the GPU, no whole model in host memory then `.to`), except
    where transformers takes none (DeepSpeed ZeRO-3)."""
    import transformers
    import transformers.integrations

    from headway.target import loading

    calls: list[dict] = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    target = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    )
    assert "device_map" not in calls[-1]
    assert {p.device.type for p in target.model.parameters()} == {"cpu"}
    stored = _checkpoint(tiny_dirs["llama"])
    state = target.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())

    assert staged_placement(torch.device("cpu")) == {}
    assert staged_placement(torch.device("cuda", 1)) == {"device_map": {"": "cuda:1"}}

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", stop)
    monkeypatch.setattr(loading, "resolve_device", lambda name: torch.device("cuda", 0))
    with pytest.raises(Stop):
        load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cuda:0"))
    assert calls[-1]["device_map"] == {"": "cuda:0"}
    monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: True)
    assert staged_placement(torch.device("cuda", 0)) == {}
