"""EAGLE-1's engine layouts (vLLM's EagleLlamaForCausalLM, SGLang's LlamaForCausalLMEagle): one
Llama decoder layer without its input norm and the fc over [embedding, hidden], with or without the
fc bias each engine reads; the mappings both ways, and the formats refused with why.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from headway.errors import HeadwayError
from headway.export.layouts.common import (
    LLAMA_KEYS,
    SGLANG,
    VLLM,
    Converter,
    inverse,
    layer_specs,
    llama_config,
    prefix_rules,
    rename,
    serve_sglang,
    serve_vllm,
)
from headway.export.layouts.gguf import GGUF_REFUSED
from headway.export.schema import Layout, Spec

E1_RULES = [(r"decoder\.layers\.0\.", "layers.0."), (r"fc\.", "fc.")]


def _eagle_specs(with_bias: bool) -> Callable[[dict], dict[str, Spec]]:
    def specs(config: dict) -> dict[str, Spec]:
        h = int(config["hidden_size"])
        # EAGLE-1 has no input norm in layer 0
        out = layer_specs(config, "layers.0.", h, input_norm=False)
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
        tensors = rename(state, prefix_rules(E1_RULES))
        # SGLang's fc always has a bias: a head without one exports zeros (exact)
        if fmt == "sglang":
            tensors["fc.bias"] = bias if bias is not None else torch.zeros(h)
        arch = "LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"
        return {**llama_config(native, fmt), "architectures": [arch]}, tensors

    return convert


def _eagle_from_engine(config: dict, tensors: dict) -> dict:
    """The native state; SGLang's fc bias (zeros for a head trained without one) is dropped
    again."""
    state = rename(tensors, prefix_rules(inverse(E1_RULES)))
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


# ---------------------------------------------------------------- the formats

EAGLE_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        _eagle_layout("vllm", VLLM),
        _eagle_to_engine("vllm"),
        _eagle_from_engine,
        serve_vllm("eagle"),
    ),
    "sglang": Converter(
        _eagle_layout("sglang", SGLANG),
        _eagle_to_engine("sglang"),
        _eagle_from_engine,
        serve_sglang("EAGLE"),
    ),
}
EAGLE_REFUSED = {
    "gguf": GGUF_REFUSED["eagle"],
    "speculators": "this exporter writes the speculators format for EAGLE-3 heads: export EAGLE-1 with "
    "--format vllm or sglang",
    "trtllm": "this exporter writes EAGLE-1 for vLLM and SGLang only (TensorRT-LLM's EAGLE-1 path builds "
    "engines from its own converter): use --format vllm or sglang, or train EAGLE-3",
}
