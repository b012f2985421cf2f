"""Exports for serving engines: every kind in every format it supports round-trips to a head that
drafts exactly as the original; each layout's tensors and config keys are what the engine reads;
broken or mismatched checkpoints are refused with the problem named."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.errors import HeadwayError
from headway.export.exporter import export_head, load_export, read_export, serve_hint
from headway.export.layouts import LAYOUTS
from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.draft_layer import draft_layer_config
from headway.heads.eagle import EagleConfig
from headway.heads.eagle3 import Eagle3Config, Eagle3Head
from headway.heads.medusa import MedusaConfig
from headway.inference.drafters.dflash import DFlashDrafter
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.tree import build_tree
from headway.inference.generate import speculative_generate
from headway.kinds.checkpoint import save_head
from headway.kinds.registry import KINDS, build_head
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from tests.helpers.tiny_models import make_tiny_model

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_head(
    t,
    kind: str,
    lm_head: str = "reduced",
    seed: int = 0,
    draft_layer: str = "target",
    feature_layers: tuple = (),
):
    """An untrained head of `kind` for target `t` with random (not identity) weights."""
    torch.manual_seed(seed)
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    d2t = torch.sort(torch.randperm(V)[:64]).values
    layer_config = draft_layer_config(t.model.config, draft_layer)
    if kind == "eagle3":
        cfg = Eagle3Config(
            draft_vocab_size=64,
            ttt_steps=2,
            draft_layer=draft_layer,
            feature_layers=list(feature_layers),
        )
        cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
        heads = build_head(kind, cfg, h, V, d2t=d2t, layer_config=layer_config)
    elif kind == "eagle":
        heads = build_head(
            kind, EagleConfig(draft_layer=draft_layer), h, V, layer_config=layer_config
        )
    elif kind == "dflash":
        cfg = DFlashConfig(
            draft_vocab_size=64,
            block_size=4,
            num_layers=2,
            feature_layers=list(feature_layers),
            lm_head="target" if lm_head == "target" else "own",
        )
        cfg.feature_layers = DFlashHead.feature_layers(cfg, L)
        llama_layer = draft_layer_config(t.model.config, "llama")
        heads = build_head(kind, cfg, h, V, d2t=d2t, layer_config=llama_layer)
    else:
        heads = build_head(
            kind,
            MedusaConfig(num_heads=3, lm_head=lm_head, draft_vocab_size=64),
            h,
            V,
            d2t=d2t if lm_head == "reduced" else None,
        )
    heads.init_from_target(t.model)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn_like(p) * 0.2)
    return heads.eval()


def drafter_for(t, heads):
    heads.attach_target(t.model)
    if heads.kind == "medusa":
        return MedusaDrafter(heads, build_tree(TREE), t.config.num_hidden_layers)
    if heads.kind == "dflash":
        return DFlashDrafter(heads, build_tree(TREE), t.config.num_hidden_layers)
    return EagleDrafter(heads, t.config.num_hidden_layers, 3, 2, 6)


def trace(t, heads) -> list:
    ids = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a cat."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = t.tokenizer(ids, add_special_tokens=False)["input_ids"]
    r = speculative_generate(t.model, drafter_for(t, heads), ids, 24, [t.tokenizer.eos_token_id])
    return [r.tokens, r.accepted]


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return load_target(
        TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    )


# DFlash for SGLang reads out through the target's lm_head (lm_head=target); vLLM takes both
# read-outs
CASES = [
    (f, k, "target" if (k, f) == ("dflash", "sglang") else "reduced")
    for k in sorted(KINDS)
    for f in sorted(LAYOUTS[k])
    if k != "medusa"
    and f != "gguf"  # gguf writes the target's tokenizer too: tests/export/test_export_gguf.py
] + [
    ("vllm", "dflash", "target"),
    ("vllm", "medusa", "shared"),
    ("vllm", "medusa", "own"),
    ("trtllm", "medusa", "shared"),
    ("trtllm", "medusa", "own"),
    ("native", "eagle3", "reduced"),
    ("native", "eagle", "reduced"),
    ("native", "medusa", "reduced"),
]


def lm_head_of(t):
    return t.model.get_output_embeddings().weight


@pytest.mark.parametrize("fmt,kind,lm_head", CASES)
def test_export_round_trips_to_a_head_that_drafts_the_same(
    llama, tmp_path: Path, fmt: str, kind: str, lm_head: str
):
    t = llama
    heads = random_head(t, kind, lm_head=lm_head)
    native = save_head(heads, tmp_path / "head", t.fingerprint)
    out = export_head(
        native,
        fmt,
        tmp_path / "out",
        dtype="float32",
        target_fingerprint=t.fingerprint,
        target_lm_head=lm_head_of(t),
        verifier="/models/target",
    )
    again = load_export(out, t.fingerprint)
    original = heads.state_dict()
    assert set(again.state_dict()) == set(original)
    for k, v in again.state_dict().items():
        assert torch.equal(v, original[k]), k
    assert trace(t, again) == trace(t, heads)
    if fmt != "native":  # the layout check passes on what was written
        assert read_export(out)[0] == fmt
    # bf16 (the default) is what gets written, floating tensors only, and it reads back too
    export_head(
        native,
        fmt,
        tmp_path / "bf16",
        target_fingerprint=t.fingerprint,
        target_lm_head=lm_head_of(t),
        verifier="/models/target",
    )
    weights = LAYOUTS[kind][fmt].layout.weights_file if fmt != "native" else "model.safetensors"
    written = load_file(str(tmp_path / "bf16" / weights))
    assert all(
        v.dtype == (torch.bfloat16 if v.is_floating_point() else torch.int64)
        or v.dtype == torch.bool
        for v in written.values()
    )
    load_export(tmp_path / "bf16", t.fingerprint)


def vllm_export(t, heads, tmp_path: Path) -> tuple[dict, dict]:
    """The head exported for vLLM in float32: its config.json and tensors as written."""
    export_head(
        save_head(heads, tmp_path / "head", t.fingerprint), "vllm", tmp_path / "v", "float32"
    )
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    return config, load_file(str(tmp_path / "v" / "model.safetensors"))


def sizes(t) -> tuple[int, int, int, int, int]:
    """The tiny Llama's hidden size, heads, key/value heads, head dim and MLP width."""
    c = t.config
    return 64, c.num_attention_heads, c.num_key_value_heads, 16, c.intermediate_size


def test_dflash_layout_is_what_vllm_reads(llama, tmp_path: Path):
    """The keys and shapes vLLM's DFlashQwen3ForCausalLM.load_weights reads (no `model.` prefix;
    embed_tokens comes from the target), and the dflash_config its proposer reads."""
    t = llama
    heads = random_head(t, "dflash")
    config, tensors = vllm_export(t, heads, tmp_path)
    h, n, kv, hd, inter = sizes(t)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (
        config["num_hidden_layers"] == 2
        and config["block_size"] == 4
        and config["draft_vocab_size"] == 64
    )
    assert config["dflash_config"] == {
        "mask_token_id": t.config.vocab_size - 1,
        "target_layer_ids": [k - 1 for k in heads.cfg.feature_layers],  # 0-based decoder layers
    }
    layer = {
        "input_layernorm.weight": [h],
        "post_attention_layernorm.weight": [h],
        "self_attn.q_proj.weight": [n * hd, h],
        "self_attn.k_proj.weight": [kv * hd, h],
        "self_attn.v_proj.weight": [kv * hd, h],
        "self_attn.o_proj.weight": [h, n * hd],
        "self_attn.q_norm.weight": [hd],
        "self_attn.k_norm.weight": [hd],
        "mlp.gate_proj.weight": [inter, h],
        "mlp.up_proj.weight": [inter, h],
        "mlp.down_proj.weight": [h, inter],
    }
    assert {k: list(v.shape) for k, v in tensors.items()} == {
        "fc.weight": [h, 3 * h],
        "hidden_norm.weight": [h],
        "norm.weight": [h],
        "lm_head.weight": [64, h],
        "d2t": [64],
        "t2d": [t.config.vocab_size],
        **{f"layers.{i}.{k}": s for i in range(2) for k, s in layer.items()},
    }
    assert torch.equal(tensors["d2t"] + torch.arange(64), heads.d2t)  # offsets, as vLLM adds them


def test_eagle3_layout_is_what_vllm_reads(llama, tmp_path: Path):
    t = llama
    heads = random_head(t, "eagle3")
    config, tensors = vllm_export(t, heads, tmp_path)
    h, n, kv, hd, inter = sizes(t)
    assert (
        config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    )
    assert (
        config["eagle_aux_hidden_state_layer_ids"] == heads.cfg.feature_layers
    )  # HF output_hidden_states indices
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == t.config.vocab_size
    assert t.config.hidden_size == h and config["head_dim"] == hd
    assert {k: list(v.shape) for k, v in tensors.items()} == {
        "fc.weight": [h, 3 * h],
        "midlayer.input_layernorm.weight": [h],
        "midlayer.hidden_norm.weight": [h],
        "midlayer.self_attn.q_proj.weight": [n * hd, 2 * h],
        "midlayer.self_attn.k_proj.weight": [kv * hd, 2 * h],
        "midlayer.self_attn.v_proj.weight": [kv * hd, 2 * h],
        "midlayer.self_attn.o_proj.weight": [h, n * hd],
        "midlayer.mlp.gate_proj.weight": [inter, h],
        "midlayer.mlp.up_proj.weight": [inter, h],
        "midlayer.mlp.down_proj.weight": [h, inter],
        "midlayer.post_attention_layernorm.weight": [h],
        "norm.weight": [h],
        "lm_head.weight": [64, h],
        "d2t": [64],
        "t2d": [t.config.vocab_size],
    }
    # d2t is an offset: target id = draft id + d2t[draft id]; t2d marks those ids
    assert torch.equal(torch.arange(64) + tensors["d2t"], heads.d2t)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(
        tensors["t2d"].nonzero().flatten(), heads.d2t
    )
    # the embedding norm and the hidden norm land where vLLM applies them (input_layernorm:
    # embeddings)
    assert torch.equal(
        tensors["midlayer.input_layernorm.weight"],
        heads.decoder.layers[0].input_layernorm.emb_norm.weight,
    )
    export_head(tmp_path / "head", "sglang", tmp_path / "s", "float32")
    sglang = json.loads((tmp_path / "s" / "config.json").read_text())
    # SGLang and TensorRT-LLM name the layer whose output they take: HF index - 1
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        k - 1 for k in heads.cfg.feature_layers
    ]


def test_eagle1_and_medusa_layouts(llama, tmp_path: Path):
    t = llama
    h, V = t.config.hidden_size, t.config.vocab_size
    export_head(
        save_head(random_head(t, "eagle"), tmp_path / "e1", t.fingerprint),
        "vllm",
        tmp_path / "e1v",
        "float32",
    )
    tensors = load_file(str(tmp_path / "e1v" / "model.safetensors"))
    assert tensors["fc.weight"].shape == (h, 2 * h) and "fc.bias" not in tensors
    assert (
        not any("input_layernorm" in k for k in tensors)
        and "layers.0.self_attn.q_proj.weight" in tensors
    )
    export_head(tmp_path / "e1", "sglang", tmp_path / "e1s", "float32")
    s = load_file(str(tmp_path / "e1s" / "model.safetensors"))
    assert torch.equal(s["fc.bias"], torch.zeros(h))  # SGLang's fc has a bias: zeros keep it exact

    medusa = random_head(t, "medusa", lm_head="shared")
    export_head(
        save_head(medusa, tmp_path / "m", t.fingerprint),
        "vllm",
        tmp_path / "mv",
        "float32",
        target_lm_head=lm_head_of(t),
    )
    config = json.loads((tmp_path / "mv" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "mv" / "model.safetensors"))
    assert config["medusa_fc_bias"] is True  # without it vLLM silently drops the blocks' biases
    assert (config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]) == (
        3,
        1,
        V,
    )
    assert config["original_lm_head"] is True and torch.equal(
        tensors["lm_heads.0.weight"], lm_head_of(t)
    )
    assert tensors["blocks.2.layers.0.bias"].shape == (h,) and "lm_heads.1.weight" not in tensors
    assert not any(
        "num" in k for k in config if k not in ("num_heads", "num_hidden_layers")
    )  # vLLM renames those
    with pytest.raises(HeadwayError, match="needs the target's weights"):
        export_head(tmp_path / "m", "vllm", tmp_path / "no-lm-head", "float32")

    own = random_head(t, "medusa", lm_head="own")
    export_head(
        save_head(own, tmp_path / "mo", t.fingerprint), "trtllm", tmp_path / "mt", "float32"
    )
    # TensorRT-LLM's load_medusa_hf: medusa_lm_head.safetensors, the original Medusa keys without a
    # prefix
    assert not (tmp_path / "mt" / "model.safetensors").exists()
    tensors = load_file(str(tmp_path / "mt" / "medusa_lm_head.safetensors"))
    assert tensors["0.0.linear.weight"].shape == (h, h) and tensors["1.1.weight"].shape == (V, h)
    assert tensors["2.0.linear.bias"].shape == (h,) and len(tensors) == 3 * 3
    config = json.loads((tmp_path / "mt" / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    export_head(tmp_path / "mo", "vllm", tmp_path / "mov", "float32")
    config = json.loads((tmp_path / "mov" / "config.json").read_text())
    assert config["original_lm_head"] is False and load_file(
        str(tmp_path / "mov" / "model.safetensors")
    )["lm_heads.2.weight"].shape == (V, h)


@pytest.mark.parametrize(
    "fmt,kind,message",
    [
        ("sglang", "medusa", "SGLang serves EAGLE drafts, not Medusa heads"),
        ("trtllm", "eagle", "EAGLE-1 for vLLM and SGLang only"),
        ("trtllm", "medusa", "TensorRT-LLM's Medusa reads heads over the full target vocabulary"),
        (
            "vllm",
            "medusa",
            "vLLM 0.32's Medusa cannot load heads with their own reduced vocabulary",
        ),
    ],
)
def test_unsupported_combinations_say_what_is(
    llama, tmp_path: Path, fmt: str, kind: str, message: str
):
    head = save_head(random_head(llama, kind), tmp_path / "h", llama.fingerprint)
    with pytest.raises(HeadwayError, match=message):
        export_head(head, fmt, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_other_families_and_biased_fc_are_refused_by_name(tiny_dirs, llama, tmp_path: Path):
    qwen = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["qwen2"]), device="cpu", num_threads=1)
    )
    head = save_head(random_head(qwen, "eagle3"), tmp_path / "q", qwen.fingerprint)
    with pytest.raises(
        HeadwayError,
        match=r"hold a Llama decoder layer; this head.s draft layer is qwen2, .*draft_layer=llama",
    ):
        export_head(head, "vllm", tmp_path / "o")
    export_head(head, "native", tmp_path / "n")  # native holds every family
    biased = build_head(
        "eagle",
        EagleConfig(fc_bias=True),
        64,
        llama.config.vocab_size,
        layer_config=draft_layer_config(llama.model.config),
    )
    torch.nn.init.normal_(biased.fc.bias)
    head = save_head(biased, tmp_path / "b", llama.fingerprint)
    with pytest.raises(HeadwayError, match="vLLM's EAGLE-1 .* has no fc bias"):
        export_head(head, "vllm", tmp_path / "o")
    export_head(head, "sglang", tmp_path / "s", "float32")
    assert torch.equal(load_export(tmp_path / "s").fc.bias, biased.fc.bias)


def test_a_head_for_another_target_is_refused(tiny_dirs, llama, tmp_path: Path):
    other = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["mistral"]), device="cpu"), with_model=False
    )
    head = save_head(random_head(llama, "eagle3"), tmp_path / "h", llama.fingerprint)
    with pytest.raises(HeadwayError, match="was made for target"):
        export_head(head, "vllm", tmp_path / "o", target_fingerprint=other.fingerprint)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("delete", r"tensor 'midlayer.self_attn.k_proj.weight' is missing \(expected shape"),
        ("shape", r"tensor 'lm_head.weight' has shape \[63, 64\], expected \[64, 64\]"),
        ("d2t", r"t2d does not mark exactly the target ids d2t maps to"),
        ("truncate", r"is truncated or damaged"),
        ("config", r"config key 'draft_vocab_size' is missing"),
    ],
)
def test_a_corrupted_export_is_refused_naming_the_problem(
    llama, tmp_path: Path, damage: str, message: str
):
    head = save_head(random_head(llama, "eagle3"), tmp_path / "h", llama.fingerprint)
    out = export_head(head, "vllm", tmp_path / "v")
    weights, config_file = out / "model.safetensors", out / "config.json"
    tensors = load_file(str(weights))
    if damage == "delete":
        del tensors["midlayer.self_attn.k_proj.weight"]
    elif damage == "shape":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:63]
    elif damage == "d2t":
        tensors["d2t"] = tensors["d2t"].clone()
        tensors["d2t"][5] += 1  # a draft id now points at a target id t2d does not mark
    if damage in (
        "delete",
        "shape",
        "d2t",
    ):  # rewritten whole, checksum dropped: only the layout check can tell
        save_file(tensors, str(weights))
        config = json.loads(config_file.read_text())
        del config["headway"]["files"]
        config_file.write_text(json.dumps(config))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        config = json.loads(config_file.read_text())
        del config["draft_vocab_size"]
        config_file.write_text(json.dumps(config))
    with pytest.raises(HeadwayError, match=message):
        load_export(out)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
@pytest.mark.parametrize("damage", ["no d2t", "identity d2t"])
def test_an_eagle3_export_whose_draft_ids_would_map_silently_is_refused(
    llama, tmp_path: Path, fmt: str, damage: str
):
    """vLLM reads a reduced draft vocabulary without d2t (or with all offsets 0) as target ids
    0..N-1,
    silently: the draft then accepts almost nothing. Such an export is refused, with that reason, at
    `--check` and
    at export."""
    head = save_head(random_head(llama, "eagle3"), tmp_path / "h", llama.fingerprint)
    out = export_head(head, fmt, tmp_path / "e", verifier="tiny-llama")
    assert read_export(out)[0] == fmt  # the whole export is accepted
    weights, config_file = out / "model.safetensors", out / "config.json"
    tensors = load_file(str(weights))
    key = "d2t" if "d2t" in tensors else "draft_id_to_target_id"
    if damage == "no d2t":
        del tensors[key]
        message = "is missing .*: without it vLLM reads draft id i as target id i, silently"
    else:
        tensors[key] = torch.zeros_like(tensors[key])
        tensors["t2d"] = torch.zeros_like(tensors["t2d"])
        tensors["t2d"][: len(tensors[key])] = True
        message = (
            "d2t maps the 64 draft ids onto the target's first 64 ids .* accepting almost nothing"
        )
    save_file(tensors, str(weights))
    config = json.loads(config_file.read_text())
    config["headway"].pop("files", None)
    config_file.write_text(json.dumps(config))
    with pytest.raises(HeadwayError, match=message):
        read_export(out)
    # a native head whose d2t is the identity (lost, or never built from the data) is refused at
    # export too
    state = load_file(str(head / "model.safetensors"))
    state["d2t"] = torch.arange(64)
    save_file(state, str(head / "model.safetensors"))
    native = json.loads((head / "config.json").read_text())
    native.pop("files", None)
    (head / "config.json").write_text(json.dumps(native))
    with pytest.raises(HeadwayError, match="onto the target's first 64 ids"):
        export_head(head, fmt, tmp_path / "e2", verifier="tiny-llama")
    assert not (tmp_path / "e2").exists()


def test_a_damaged_native_head_is_not_exported(llama, tmp_path: Path):
    head = save_head(
        random_head(llama, "medusa", lm_head="own"), tmp_path / "run" / "head", llama.fingerprint
    )
    export_head(tmp_path / "run", "vllm", tmp_path / "from-run")  # a run directory exports its head
    assert read_export(tmp_path / "from-run")[0] == "vllm"
    (head / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes()[:-64])
    with pytest.raises(HeadwayError, match="the file is damaged"):
        export_head(head, "vllm", tmp_path / "o")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- what each engine's loader reads, replayed


def vllm_eagle3_load(config: dict, tensors: dict) -> tuple[list[int], dict]:
    """vLLM 0.32's Eagle3LlamaForCausalLM as it reads a checkpoint: the fused layers from the
    top-level key as written (else eagle_config's, else its default), midlayer.* renamed to
    layers.0.*, d2t kept as draft_id_to_target_id, t2d dropped, fc as wide as 3 x
    target_hidden_size."""
    layers = config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    params = {}
    for name, t in tensors.items():
        if name == "t2d":
            continue
        name = "draft_id_to_target_id" if name == "d2t" else name.replace("midlayer.", "layers.0.")
        params[name] = t
    assert params["fc.weight"].shape[1] == 3 * config["target_hidden_size"]
    return list(layers), params


def sglang_eagle3_layers(config: dict) -> list[int]:
    """SGLang: only eagle_config's list, plus one (it names the layer before whose input it
    captures)."""
    return [k + 1 for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def vllm_speculators_config(config: dict) -> dict:
    """vLLM's speculators path (update_eagle3, build_vllm_speculative_config): what it makes of the
    config."""
    spec = config["speculators_config"]
    assert "model_type" not in config and spec["proposal_methods"][0]["speculative_tokens"] >= 1
    return {
        "norm_before_residual": config.get(
            "norm_before_residual", True
        ),  # vLLM's default differs from Headway's
        "num_speculative_tokens": spec["proposal_methods"][0]["speculative_tokens"],
        "target": spec["verifier"]["name_or_path"],
        "layers": config.get("eagle_aux_hidden_state_layer_ids"),
    }


def test_non_default_feature_layers_reach_every_engine_as_the_same_layers(llama, tmp_path: Path):
    """One head, fused layers [1, 3] plus 2: vLLM, SGLang, TensorRT-LLM and speculators each read
    layers 1, 2, 3 of HF's output_hidden_states, whatever each engine's indexing."""
    t = llama
    heads = random_head(t, "eagle3", feature_layers=(1, 2, 3))
    head = save_head(heads, tmp_path / "h", t.fingerprint)
    want = [1, 2, 3]
    for fmt in ("vllm", "sglang", "trtllm", "speculators"):
        out = export_head(head, fmt, tmp_path / fmt, "float32", verifier="/models/target")
        config = json.loads((out / "config.json").read_text())
        tensors = load_file(str(out / "model.safetensors"))
        vllm_layers, params = vllm_eagle3_load(config, tensors)
        assert vllm_layers == want, fmt
        if fmt != "speculators":
            assert sglang_eagle3_layers(config) == want and config["norm_before_residual"] is False
            assert "layers.0.self_attn.q_proj.weight" in params
        assert load_export(out).cfg.feature_layers == want
    trt = json.loads((tmp_path / "trtllm" / "config.json").read_text())
    assert "eagle3_layers_to_capture={0, 1, 2}" in serve_hint("trtllm", trt, tmp_path / "trtllm")


def test_speculators_export_is_self_describing(llama, tmp_path: Path):
    t = llama
    heads = random_head(t, "eagle3", draft_layer="llama")
    heads.cfg.ttt_steps = 5
    out = export_head(
        save_head(heads, tmp_path / "h", t.fingerprint),
        "speculators",
        tmp_path / "s",
        "float32",
        verifier="/models/smollm2",
    )
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    seen = vllm_speculators_config(config)
    assert seen == {
        "norm_before_residual": False,
        "num_speculative_tokens": 5,
        "target": "/models/smollm2",
        "layers": heads.cfg.feature_layers,
    }
    assert (
        config["architectures"] == ["Eagle3Speculator"]
        and config["transformer_layer_config"]["model_type"] == "llama"
    )
    assert "layers.0.hidden_norm.weight" in tensors and not any(
        k.startswith("midlayer.") for k in tensors
    )
    assert "vllm serve" in serve_hint(
        "speculators", config, out
    ) and "5 draft tokens" in serve_hint("speculators", config, out)
    with pytest.raises(HeadwayError, match="verifier.name_or_path is empty"):
        export_head(tmp_path / "h", "speculators", tmp_path / "no-verifier", "float32")


def test_speculators_own_config_classes_accept_the_export(llama, tmp_path: Path):
    """speculators' Eagle3SpeculatorConfig validates what the exporter writes (a dev-only
    dependency)."""
    speculators = pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig

    t = llama
    out = export_head(
        save_head(random_head(t, "eagle3", draft_layer="llama"), tmp_path / "h", t.fingerprint),
        "speculators",
        tmp_path / "s",
        "float32",
        verifier="/models/target",
    )
    config = json.loads((out / "config.json").read_text())
    parsed = SpeculatorModelConfig.from_dict({k: v for k, v in config.items() if k != "headway"})
    assert type(parsed).__name__ == "Eagle3SpeculatorConfig" and speculators is not None
    assert parsed.norm_before_residual is False and parsed.draft_vocab_size == 64
    assert parsed.speculators_config.proposal_methods[0].speculative_tokens == 2
    assert parsed.speculators_config.verifier.name_or_path == "/models/target"


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_llama_style_heads_for_other_families_export_and_draft_the_same(
    tiny_dirs, tmp_path: Path, arch: str, kind: str
):
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs[arch]), device="cpu", num_threads=1))
    heads = random_head(t, kind, draft_layer="llama")
    assert heads.decoder.config.model_type == "llama"
    head = save_head(heads, tmp_path / "h", t.fingerprint)
    for fmt in ("vllm", "sglang"):
        out = export_head(head, fmt, tmp_path / fmt, "float32")
        config = json.loads((out / "config.json").read_text())
        assert (
            config["num_key_value_heads"] == t.config.num_key_value_heads
            and config["hidden_act"] == "silu"
        )
        again = load_export(out, t.fingerprint)
        assert trace(t, again) == trace(t, heads)


def test_gemma3_engine_exports_are_refused_with_the_reason(tiny_dirs, tmp_path: Path):
    t = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["gemma3"]), device="cpu", num_threads=1)
    )
    head = save_head(random_head(t, "eagle3", draft_layer="llama"), tmp_path / "h", t.fingerprint)
    for fmt in ("vllm", "sglang", "speculators"):
        with pytest.raises(
            HeadwayError,
            match=r"cannot serve an EAGLE draft for a gemma3\w* target: vLLM 0.32's "
            r"Gemma3ForCausalLM does not implement SupportsEagle3",
        ):
            export_head(head, fmt, tmp_path / fmt, verifier="/models/target")
    export_head(head, "native", tmp_path / "n")


def test_medusa_for_vllm_is_refused_where_vllm_has_dropped_it(llama, tmp_path: Path, monkeypatch):
    from headway.export.layouts import medusa as medusa_layouts

    head = save_head(random_head(llama, "medusa", lm_head="own"), tmp_path / "m", llama.fingerprint)
    monkeypatch.setattr(medusa_layouts, "installed_vllm", lambda: (0, 33))
    with pytest.raises(
        HeadwayError, match=r"vLLM 0.33 is installed here, and vLLM 0.33 removed Medusa"
    ):
        export_head(head, "vllm", tmp_path / "v")
    monkeypatch.setattr(medusa_layouts, "installed_vllm", lambda: (0, 32))
    out = export_head(head, "vllm", tmp_path / "v", "float32")
    hint = serve_hint("vllm", json.loads((out / "config.json").read_text()), out)
    assert (
        '"num_speculative_tokens": 3' in hint and "0.33 removed Medusa" in hint
    )  # sized from the head's 3 heads
    trt = export_head(head, "trtllm", tmp_path / "t", "float32")
    hint = serve_hint("trtllm", json.loads((trt / "config.json").read_text()), trt)
    assert (
        "--num_medusa_heads 3 --num_medusa_layers 1" in hint
        and "--speculative_decoding_mode medusa" in hint
    )


@pytest.mark.parametrize(
    "layers,message",
    [
        ([15, 2, 27], "give 3 distinct target layer outputs in ascending order"),
        ([2, 2, 27], "give 3 distinct target layer outputs in ascending order"),
        ([0, 2, 3], "each from 1"),
        ([2, 15], "give 3 distinct"),
    ],
)
def test_feature_layers_are_checked_when_the_config_is_read(layers, message):
    with pytest.raises(HeadwayError, match=message):
        Eagle3Config(feature_layers=layers)


def test_the_last_layer_is_refused_for_training(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.train.loop import train
    from tests.helpers.train_helpers import small_run

    with pytest.raises(
        HeadwayError, match=r"feature_layers \[4\] outside this 4-layer target's 1..3"
    ):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "r",
                "head.kind=eagle3",
                "head.eagle3.feature_layers=[1,2,4]",
            )
        )


# ---------------------------------------------------------------- EAGLE-3.1's norms


def eagle31_head(t, input_norm: str, norm_output: bool):
    """An EAGLE-3 head with EAGLE-3.1's norms, every weight random (the norms' too, so a lost norm
    shows)."""
    torch.manual_seed(1)
    L, h, V = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    cfg = Eagle3Config(
        draft_vocab_size=64,
        ttt_steps=2,
        draft_layer="llama",
        input_norm=input_norm,
        norm_output=norm_output,
    )
    cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
    d2t = torch.sort(torch.randperm(V)[:64]).values
    heads = build_head(
        "eagle3", cfg, h, V, d2t=d2t, layer_config=draft_layer_config(t.model.config, "llama")
    )
    heads.init_from_target(t.model)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return heads.eval()


@pytest.mark.parametrize(
    "input_norm,norm_output", [("per_layer", True), ("concat", False), ("none", True)]
)
def test_eagle31_heads_export_for_speculators_and_draft_the_same_again(
    llama, tmp_path: Path, input_norm: str, norm_output: bool
):
    """speculators' keys for the norms are written (and its own config class accepts them), the
    weights under its names, and in vLLM's own layout; the re-imported head drafts exactly as the
    original. Engine layouts without the keys (SGLang's, TensorRT-LLM's) refuse the head."""
    speculators = pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig

    t = llama
    heads = eagle31_head(t, input_norm, norm_output)
    native = save_head(heads, tmp_path / "head", t.fingerprint)
    out = export_head(native, "speculators", tmp_path / "s", "float32", verifier="/models/target")
    config = json.loads((out / "config.json").read_text())
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (
        input_norm == "concat",
        input_norm == "per_layer",
        norm_output,
    )
    parsed = SpeculatorModelConfig.from_dict({k: v for k, v in config.items() if k != "headway"})
    assert (parsed.norm_before_fc, parsed.fc_norm, parsed.norm_output) == (
        config["norm_before_fc"],
        config["fc_norm"],
        config["norm_output"],
    ) and speculators is not None
    tensors = load_file(str(out / "model.safetensors"))
    norms = {k for k in tensors if k.startswith(("fc_norm.", "input_norm."))}
    assert (
        norms
        == {
            "per_layer": {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"},
            "concat": {"input_norm.weight"},
            "none": set(),
        }[input_norm]
    )
    again = load_export(out, t.fingerprint)
    assert (again.cfg.input_norm, again.cfg.norm_output) == (input_norm, norm_output)
    assert trace(t, again) == trace(t, heads)
    # vLLM's own layout carries them too (its Eagle3LlamaForCausalLM reads the same keys and weight
    # names)
    vllm = export_head(native, "vllm", tmp_path / "v", "float32")
    vconfig = json.loads((vllm / "config.json").read_text())
    assert {k: vconfig[k] for k in ("norm_before_fc", "fc_norm", "norm_output")} == {
        k: config[k] for k in ("norm_before_fc", "fc_norm", "norm_output")
    }
    assert {
        k
        for k in load_file(str(vllm / "model.safetensors"))
        if k.startswith(("fc_norm.", "input_norm."))
    } == norms
    again = load_export(vllm, t.fingerprint)
    assert (again.cfg.input_norm, again.cfg.norm_output) == (input_norm, norm_output)
    assert trace(t, again) == trace(t, heads)
    for fmt in ("sglang", "trtllm"):
        with pytest.raises(HeadwayError, match="EAGLE-3.1's .* the .* layout has no keys for"):
            export_head(native, fmt, tmp_path / fmt)


def test_a_head_saved_before_eagle31_keeps_its_meaning(llama, tmp_path: Path):
    """A head directory without the EAGLE-3.1 settings (written before they existed) loads with both
    off."""
    from headway.kinds.checkpoint import load_head

    heads = random_head(llama, "eagle3")
    out = save_head(heads, tmp_path / "h", llama.fingerprint)
    config = json.loads((out / "config.json").read_text())
    for key in ("input_norm", "norm_output"):
        config["head"].pop(key)
    (out / "config.json").write_text(json.dumps(config))
    again = load_head(out, llama.fingerprint)
    assert (again.cfg.input_norm, again.cfg.norm_output) == ("none", False)
    assert trace(llama, again) == trace(llama, heads)


# ---------------------------------------------------------------- the target's RoPE, as each engine reads it

ENGINE_FORMATS = ("vllm", "sglang", "trtllm", "speculators")
# The scalings every engine's Llama draft layer computes as transformers does: the tiny llama3
# target as built (tests/helpers/tiny_models.py), and linear, yarn and default variants of it (its
# config.json edited).
ROPES = {
    "llama3": None,
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "rope_theta": 500000.0,
    },
    "default": {"rope_type": "default", "rope_theta": 500000.0},
}
POSITIONS = torch.tensor([0, 1, 7, 17, 63, 64, 130, 257, 511])


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("llama3") / "t")


def rope_target(llama3_dir: Path, tmp_path: Path, rope: dict | None):
    """The tiny llama3 target, its rope_parameters replaced by `rope` (None: as built)."""
    if rope is None:
        return load_target(TargetConfig(name_or_path=str(llama3_dir), device="cpu", num_threads=1))
    d = tmp_path / "target"
    shutil.copytree(llama3_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"] = rope
    (d / "config.json").write_text(json.dumps(config))
    return load_target(TargetConfig(name_or_path=str(d), device="cpu", num_threads=1))


def native_cos_sin(heads) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables the head's trained draft layer applies at POSITIONS ([P, head_dim / 2])."""
    cos, sin = heads.decoder.rotary_emb(torch.zeros(1), POSITIONS[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def hf_cos_sin(layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables a transformers LlamaConfig built from an exported layer config gives."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig.from_dict({k: v for k, v in layer.items() if k != "headway"})
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), POSITIONS[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def vllm_rope(config: dict) -> tuple[dict, dict]:
    """What vLLM's get_rope receives for the draft layer (speculators: transformer_layer_config goes
    into the draft's config as it is): with transformers 4, patch_rope_parameters makes
    `rope_scaling` the rope_parameters and puts the top-level rope_theta in; with transformers 5,
    the rope_parameters."""
    layer = config.get("transformer_layer_config", config)
    v4 = {
        **(layer.get("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": layer["rope_theta"],
    }
    return v4, layer["rope_parameters"]


def sglang_rope(config: dict) -> tuple[float, dict | None]:
    """SGLang's LlamaDecoderLayer: (config.rope_theta, config.rope_scaling) with transformers 4; its
    get_rope reads rope_type (or type), factor, low/high_freq_factor,
    original_max_position_embeddings, beta_fast, beta_slow, extrapolation_factor, attn_factor and
    truncate from the dict."""
    return config["rope_theta"], config.get("rope_scaling")


def trtllm_rope(config: dict) -> dict:
    """TensorRT-LLM's RopeParams.from_config: the type from rope_scaling's `type` or `rope_type`,
    its factor, low/high_freq_factor, original_max_position_embeddings (a top-level one first),
    beta_fast, beta_slow, mscale (1.0) and mscale_all_dim (0.0); theta from rope_theta."""
    s = config.get("rope_scaling")
    if s is None:
        return {"type": "none", "theta": config["rope_theta"]}
    return {
        "type": s.get("type") or s.get("rope_type"),
        "theta": config["rope_theta"],
        "scale": s.get("factor", 1.0),
        "low_freq_factor": s.get("low_freq_factor", 1.0),
        "high_freq_factor": s.get("high_freq_factor", 4.0),
        "original_max_positions": config.get("original_max_position_embeddings")
        or s.get("original_max_position_embeddings")
        or 1024,
        "beta_fast": s.get("beta_fast", 32),
        "beta_slow": s.get("beta_slow", 1),
        "yarn_mscale_ratio": (0.1 * s.get("mscale", 1.0) * math.log(s.get("factor", 1.0)) + 1.0)
        / (0.1 * s.get("mscale_all_dim", 0.0) * math.log(s.get("factor", 1.0)) + 1.0),
    }


def engine_cos_sin(rope: dict, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables vLLM builds from what its get_rope received (RotaryEmbedding,
    LinearScalingRotaryEmbedding, Llama3RotaryEmbedding, YaRNScalingRotaryEmbedding: their formulas,
    which SGLang's and TensorRT-LLM's follow), at POSITIONS."""
    base, kind = float(rope["rope_theta"]), rope.get("rope_type", "default")
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    pos, mscale = POSITIONS.float(), 1.0
    if kind == "linear":
        pos = pos / rope["factor"]
    elif kind == "llama3":
        f, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wave = 2 * math.pi / inv
        smooth = (old / wave - lo) / (hi - lo)
        inv = torch.where(
            wave < old / hi,
            inv,
            torch.where(wave > old / lo, inv / f, (1 - smooth) * inv / f + smooth * inv),
        )
    elif kind == "yarn":
        f, old = rope["factor"], rope["original_max_position_embeddings"]

        def dim(rotations: float) -> float:
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim(rope.get("beta_fast", 32))), 0)
        high = min(math.ceil(dim(rope.get("beta_slow", 1))), head_dim - 1)
        ramp = (
            (torch.arange(head_dim // 2, dtype=torch.float) - low) / max(high - low, 0.001)
        ).clamp(0, 1)
        inv = inv / f * ramp + inv * (1 - ramp)
        mscale = 0.1 * math.log(f) + 1.0
    else:
        assert kind == "default", kind
    freqs = pos[:, None] * inv[None]
    return freqs.cos() * mscale, freqs.sin() * mscale


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_the_targets_rope_scaling_reaches_every_engine_as_trained(
    llama3_dir, tmp_path: Path, rope_type: str
):
    """A head trained on a llama3 (linear, yarn) RoPE target computes that RoPE's tables; every
    engine export carries it in the keys each engine reads, the engines' tables from them equal the
    trained layer's, and a re-imported export restores it."""
    speculators = pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig

    t = rope_target(llama3_dir, tmp_path, ROPES[rope_type])
    heads = random_head(t, "eagle3", draft_layer="llama")
    trained = dict(heads.decoder.config.rope_parameters)
    assert trained["rope_type"] == rope_type == heads.decoder.rotary_emb.rope_type
    assert trained == dict(t.model.config.rope_parameters)  # the target's own RoPE
    cos, sin = native_cos_sin(heads)
    hd = heads.decoder.config.head_dim
    plain = engine_cos_sin({"rope_type": "default", "rope_theta": trained["rope_theta"]}, hd)
    # the scaling changes it
    assert (rope_type == "default") == torch.allclose(cos, plain[0], atol=1e-4)
    scaling = {k: v for k, v in trained.items() if k != "rope_theta"}
    head = save_head(heads, tmp_path / "h", t.fingerprint)
    for fmt in ENGINE_FORMATS:
        out = export_head(head, fmt, tmp_path / fmt, "float32", verifier="/models/target")
        config = json.loads((out / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert (
            layer["rope_theta"] == trained["rope_theta"] and layer["rope_parameters"] == trained
        ), fmt
        assert layer.get("rope_scaling") == (None if rope_type == "default" else scaling), fmt
        assert vllm_rope(config) == (trained, trained), fmt
        if fmt != "speculators":
            assert sglang_rope(config) == (trained["rope_theta"], layer.get("rope_scaling")), fmt
            trt = trtllm_rope(config)
            assert trt["type"] == ("none" if rope_type == "default" else rope_type), fmt
            if rope_type == "llama3":
                assert (trt["scale"], trt["low_freq_factor"], trt["high_freq_factor"]) == (
                    8.0,
                    1.0,
                    4.0,
                )
                assert trt["original_max_positions"] == 64
            if rope_type == "yarn":
                assert (
                    trt["scale"],
                    trt["original_max_positions"],
                    trt["beta_fast"],
                    trt["beta_slow"],
                ) == (
                    4.0,
                    128,
                    32.0,
                    1.0,
                )
                assert trt["yarn_mscale_ratio"] == pytest.approx(0.1 * math.log(4.0) + 1.0)
        else:
            parsed = SpeculatorModelConfig.from_dict(
                {k: v for k, v in config.items() if k != "headway"}
            )
            assert dict(parsed.transformer_layer_config.rope_parameters) == trained and speculators
        # the tables: what the engine computes from the keys it read, and transformers from
        # config.json
        engine = engine_cos_sin(vllm_rope(config)[0], hd)
        assert torch.allclose(engine[0], cos, atol=1e-4) and torch.allclose(
            engine[1], sin, atol=1e-4
        ), fmt
        hf = hf_cos_sin(layer)
        assert torch.equal(hf[0], cos) and torch.equal(hf[1], sin), fmt
        again = load_export(out, t.fingerprint)
        assert dict(again.decoder.config.rope_parameters) == trained, fmt
        assert all(torch.equal(a, b) for a, b in zip(native_cos_sin(again), (cos, sin))), fmt
    # an edited config.json: the re-imported head takes the RoPE vLLM serves
    if rope_type == "linear":
        config = json.loads((tmp_path / "vllm" / "config.json").read_text())
        config["rope_scaling"]["factor"] = 2.0
        (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
        assert load_export(tmp_path / "vllm").decoder.config.rope_parameters["factor"] == 2.0


@pytest.mark.parametrize(
    "rope,fmts,message",
    [
        (
            {"rope_type": "dynamic", "factor": 2.0},
            ENGINE_FORMATS,
            "rope_type=dynamic, which the {fmt} export cannot give {engine} exactly: the engines scale "
            "dynamic NTK's base once",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
            ENGINE_FORMATS,
            "rope_type=longrope, which the {fmt} export cannot give {engine} exactly: the engines choose "
            "LongRoPE's",
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "attention_factor": 1.0,
            },
            ENGINE_FORMATS,
            r"rope_type=yarn, which the {fmt} export cannot give {engine} exactly: attention_factor=1.0 is "
            r"not read \(the engines scale cos/sin by 0.1 ln\(factor\) \+ 1 = 1.13863\)",
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "truncate": False,
            },
            ("trtllm",),
            "rope_type=yarn, which the {fmt} export cannot give {engine} exactly: truncate=false is not read",
        ),
    ],
)
def test_rope_an_engine_computes_otherwise_is_refused_naming_type_and_engine(
    llama3_dir, tmp_path: Path, rope: dict, fmts: tuple, message: str
):
    t = rope_target(llama3_dir, tmp_path, None)
    head = save_head(random_head(t, "eagle3", draft_layer="llama"), tmp_path / "h", t.fingerprint)
    native = json.loads((head / "config.json").read_text())
    native["draft_layer"]["rope_parameters"] = {**rope, "rope_theta": 500000.0}
    (head / "config.json").write_text(json.dumps(native))
    engines = {
        "vllm": "vLLM",
        "sglang": "SGLang",
        "trtllm": "TensorRT-LLM",
        "speculators": "vLLM (speculators format)",
    }
    for fmt in fmts:
        want = message.format(fmt=fmt, engine=re.escape(engines[fmt]))
        with pytest.raises(HeadwayError, match=want) as e:
            export_head(head, fmt, tmp_path / fmt, verifier="/models/target")
        assert "\n" not in str(e.value) and "--format native" in str(e.value)
        assert not (tmp_path / fmt).exists()
    export_head(head, "native", tmp_path / "native")  # native holds every RoPE
