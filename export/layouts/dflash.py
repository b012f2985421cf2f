"""DFlash's engine layouts: vLLM's DFlashQwen3ForCausalLM and SGLang's DFlashDraftModel (Qwen3-style
layers, the fc over the fused target layers, an own draft-vocabulary read-out with its d2t or the
target's lm_head); the mappings both ways, SGLang's refusal of an own read-out, how each is served,
and the formats refused with why. llama.cpp's `dflash` GGUF is gguf_dflash.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from headway.errors import HeadwayError
from headway.export.layouts.common import (
    D2T_MISSING,
    LLAMA_KEYS,
    Converter,
    check_d2t,
    layer_shape,
    layer_specs,
    llama_config,
    serve_vllm,
)
from headway.export.layouts.gguf_dflash import GGUF_DFLASH
from headway.export.schema import Layout, Spec
from headway.heads.dflash import mask_token


def _dflash_specs(config: dict) -> dict[str, Spec]:
    """vLLM's DFlashQwen3ForCausalLM and SGLang's DFlashDraftModel: Qwen3-style layers (per-head q/k
    norms), fc over the fused target layers, the shared hidden_norm and the final norm; a
    draft-vocabulary lm_head with its d2t where the config names a draft_vocab_size, else (both
    engines' default) the target's own lm_head reads out. embed_tokens always comes from the
    target."""
    h, _, _, _, hd = layer_shape(config)
    target_h = int(config.get("target_hidden_size") or h)
    fused = len(config["dflash_config"]["target_layer_ids"])
    specs: dict[str, Spec] = {}
    for i in range(int(config["num_hidden_layers"])):
        specs.update(layer_specs(config, f"layers.{i}.", h, input_norm=True))
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
    return check_d2t(config, tensors) if "d2t" in tensors else []


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
        # both engines read the context layers as 0-based decoder layer indices (HF
        # output_hidden_states index
        # - 1); no `causal` key: the block attends within itself both ways, as it was trained
        "dflash_config": {
            "mask_token_id": mask_token(int(head["mask_token_id"]), int(native["vocab_size"])),
            "target_layer_ids": layer_ids,
        },
    }


def _dflash_to_engine(native: dict, state: dict, **_: Any) -> tuple[dict, dict]:
    """Headway's DFlash keys are the engines'. An own read-out adds draft_vocab_size, lm_head and
    d2t (as offsets); lm_head=target writes none of them, so the engine reads out through the
    target's lm_head."""
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
            "SGLang's DFlash drafts through the target's own full-vocabulary lm_head and silently drops a "
            "draft's lm_head and d2t, but this head reads out through its own reduced-vocabulary lm_head "
            "(head.dflash.lm_head=own): SGLang would serve it with the wrong read-out. Export it with "
            "--format vllm, or train a head for SGLang with head.dflash.lm_head=target"
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


def _serve_sglang_dflash(out: Any, config: dict, k: int) -> str:
    return (
        f"python -m sglang.launch_server --model TARGET_DIR --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {config['block_size']}"
    )


# ---------------------------------------------------------------- the formats

DFLASH_KEYS = LLAMA_KEYS + ("architectures", "dflash_config", "block_size")
DFLASH_EXPORTS: dict[str, Converter] = {
    "vllm": Converter(
        Layout(
            "vllm/dflash",
            "vLLM's DFlash (DFlashQwen3ForCausalLM; needs a "
            "non-causal attention backend, e.g. FlashAttention)",
            DFLASH_KEYS,
            {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"},
            _dflash_specs,
            _check_dflash_read_out,
        ),
        _dflash_to_engine,
        _dflash_from_engine,
        serve_vllm("dflash", "  (vLLM's DFlash runs on GPUs with FlashAttention)"),
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
    "gguf": GGUF_DFLASH,  # llama.cpp's dflash architecture (gguf_dflash.py)
}
DFLASH_REFUSED = {
    "trtllm": "this exporter writes DFlash for vLLM and SGLang: use --format vllm or sglang",
    "speculators": "vLLM reads DFlash's own config: export with --format vllm",
}
