"""The family table: for each target family (a config's `model_type`), which engines run it exactly,
which attention implementation it loads with, whether engines can serve a draft for it, and why not
where they cannot. Every command asks it, from the target's config.json, before the model loads;
docs/targets.md is written from it (`python -m headway.target.families > docs/targets.md`).

Exact by construction means: on the static engine and the CUDA backend a tree's rows get the bits a
one-token step gives them, in every format they run (float32, and bf16 through their row-exact
kernels); on the hf engine (the model's own forward through transformers) a tree's rows and a single
row round differently in bf16, so only float32 and float64 are exact there (float32 up to near-ties,
as on every engine).

Torch-free, like every config module, so that the command line checks a target before it loads
torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from headway.errors import HeadwayError

# the decoding engines (inference.engine values that name one engine; compiled is the static engine
# compiled)
ENGINES = ("static", "cuda", "hf")
# the dtypes each engine decodes exactly: the row-exact engines in every format, the hf engine in
# float32 and float64 only
EXACT_DTYPES = {
    "static": ("float32", "float64", "bfloat16", "float16"),
    "cuda": ("float32", "float64", "bfloat16", "float16"),
    "hf": ("float32", "float64"),
}
# what a layer of `layer_types` may be on a family whose state is a KV cache
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
# rope types whose tables depend on the sequence length, not the position alone: the static engine
# and the CUDA backend precompute tables per position, so they refuse these
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class Family:
    """One row of the table.

    Attributes:
        name: what the docs call it.
        model_types: the config `model_type` values it covers.
        engines: the engines that run it exactly (a config may still rule one out: see
            `engine_support`).
        attention: the attn_implementation `target.attn_implementation=auto` loads it with.
        unserved: why serving engines cannot serve an EAGLE draft for it ("" = they can).
        refused: why speculative decoding refuses it ("" = it decodes).
        notes: what a user should know (one line each).
    """

    name: str
    model_types: tuple[str, ...]
    engines: tuple[str, ...] = ("hf",)
    attention: str = "sdpa"
    unserved: str = ""
    refused: str = ""
    notes: tuple[str, ...] = field(default=())


_GEMMA3_UNSERVED = (
    "vLLM 0.32's Gemma3ForCausalLM does not implement SupportsEagle3 (it hands no aux hidden states to a "
    "draft), and SGLang's Gemma-3 captures a layer's branch output without its residual, not the hidden "
    "state Headway trains on"
)
_RECURRENT = (
    "its layers keep a recurrent state (SSM, linear attention or convolution) beside the KV cache, and a "
    "draft tree's branches would share that one state: Headway cannot verify a tree on it exactly"
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "Llama (Llama-2, Llama-3.x with llama3 rope, SmolLM2)", ("llama",), ("static", "cuda", "hf")
    ),
    Family("Qwen2 / Qwen2.5", ("qwen2",), ("static", "cuda", "hf")),
    Family(
        "Mistral",
        ("mistral",),
        ("static", "cuda", "hf"),
        notes=("with a sliding window: the hf engine only",),
    ),
    Family("Qwen3", ("qwen3",), ("static", "cuda", "hf")),
    Family("Qwen3-MoE", ("qwen3_moe",), ("static", "hf")),
    Family("Mixtral", ("mixtral",), ("static", "hf")),
    Family("SmolLM3 (NoPE layers)", ("smollm3",), ("static", "cuda", "hf")),
    Family(
        "gpt-oss",
        ("gpt_oss",),
        ("hf",),
        attention="eager",
        notes=(
            "attention sinks: transformers runs it with eager attention (its sdpa path has no sinks)",
        ),
    ),
    Family(
        "Gemma-2",
        ("gemma2",),
        ("hf",),
        attention="eager",
        notes=("attention logit soft-capping: transformers runs it with eager attention",),
    ),
    Family(
        "Gemma-3 (text)",
        ("gemma3_text", "gemma3"),
        ("cuda", "hf"),
        unserved=_GEMMA3_UNSERVED,
    ),
    Family("Phi-3 / Phi-4-mini", ("phi3",), ("hf",)),
    Family("OLMo-2", ("olmo2",), ("hf",)),
    Family("Granite", ("granite",), ("hf",)),
    Family("GLM", ("glm",), ("hf",)),
    Family("Falcon-H1", ("falcon_h1",), (), refused=_RECURRENT),
    Family("Jamba", ("jamba",), (), refused=_RECURRENT),
    Family("Qwen3-Next", ("qwen3_next",), (), refused=_RECURRENT),
    Family(
        "Qwen3.5",
        ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        (),
        refused=_RECURRENT,
    ),
    Family("LFM2", ("lfm2", "lfm2_moe", "lfm2_vl"), (), refused=_RECURRENT),
    Family(
        "Mamba, Bamba, Zamba, Nemotron-H, Granite-4 hybrid, RecurrentGemma, RWKV, MiniMax, Kimi-Linear",
        (
            "mamba",
            "mamba2",
            "falcon_mamba",
            "bamba",
            "zamba",
            "zamba2",
            "nemotron_h",
            "granitemoehybrid",
            "recurrent_gemma",
            "rwkv",
            "minimax",
            "kimi_linear",
            "plamo2",
        ),
        (),
        refused=_RECURRENT,
    ),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def config_dict(config: Any) -> dict:
    """A target config (transformers config object, dict, or a model directory) as the text model's
    dict."""
    if isinstance(config, (str, Path)):
        config = json.loads((Path(config) / "config.json").read_text())
    if not isinstance(config, dict):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        config = text.to_dict()
        config.setdefault("model_type", getattr(text, "model_type", None))
    elif isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type")}
    return config


def family_of(config: Any) -> Family:
    """The table's row for this config; a family not in the table runs through transformers (hf)
    alone, and is refused where its layer types say it keeps a recurrent state."""
    cfg = config_dict(config)
    model_type = str(cfg.get("model_type") or "?")
    if model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    odd = sorted({t for t in cfg.get("layer_types") or [] if t not in ATTENTION_LAYERS})
    if odd:
        return Family(
            model_type, (model_type,), (), refused=f"{_RECURRENT} (layer types {', '.join(odd)})"
        )
    return Family(
        model_type,
        (model_type,),
        ("hf",),
        notes=("not in Headway's family table: runs through transformers, exact in float32",),
    )


def rope_type(config: Any) -> str:
    """The target's rope type (default, linear, llama3, yarn, dynamic, longrope, ...)."""
    cfg = config_dict(config)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    return str(rope.get("rope_type") or rope.get("type") or "default")


def has_sliding_window(config: Any) -> bool:
    """Whether a layer attends over a sliding window (a window set, and a layer of that kind or no
    kinds)."""
    cfg = config_dict(config)
    kinds = cfg.get("layer_types") or []
    return bool(cfg.get("sliding_window")) and (not kinds or "sliding_attention" in kinds)


def engine_support(config: Any) -> dict[str, str]:
    """For each engine, "" where it runs this target exactly, else the reason it does not."""
    fam = family_of(config)
    out = {}
    for engine in ENGINES:
        if fam.refused:
            out[engine] = f"{fam.name}: {fam.refused}"
        elif engine not in fam.engines:
            out[engine] = f"the {engine} engine does not implement {fam.name}'s layers"
        elif engine != "hf" and rope_type(config) in LENGTH_DEPENDENT_ROPE:
            out[engine] = f"rope_type={rope_type(config)} rescales with the sequence length"
        elif engine == "static" and has_sliding_window(config):
            out[engine] = (
                "the static engine runs full attention only, and this target has a sliding window"
            )
        elif (
            engine == "cuda" and has_sliding_window(config) and fam.model_types[0] != "gemma3_text"
        ):
            out[engine] = "the CUDA backend runs sliding windows for Gemma-3 only"
        elif engine == "cuda" and config_dict(config).get("attn_logit_softcapping") is not None:
            out[engine] = "the CUDA backend's attention has no logit soft-capping"
        else:
            out[engine] = ""
    return out


def choose_engine(config: Any, requested: str, on_cuda: bool) -> str:
    """The engine `inference.engine=requested` means for this target (compiled counts as static):
    auto is the CUDA backend on a CUDA device where it runs the target, else static where it does,
    else hf.

    Raises:
        HeadwayError: the requested engine cannot run this target (one line: why, and what to
            use)."""
    support = engine_support(config)
    refuse_speculative(config)
    if requested == "auto":
        if on_cuda and not support["cuda"]:
            return "cuda"
        return "static" if not support["static"] else "hf"
    which = "static" if requested == "compiled" else requested
    if which in support and support[which]:
        name = family_of(config).name
        raise HeadwayError(
            f"inference.engine={requested} cannot run this {name} target: {support[which]}; "
            "use inference.engine=auto (docs/targets.md)"
        )
    return requested


def refuse_speculative(config: Any) -> None:
    """Raise one line where speculative decoding cannot be exact on this target at all."""
    fam = family_of(config)
    if fam.refused:
        raise HeadwayError(
            f"speculative decoding refuses this {config_dict(config).get('model_type')} target ({fam.name}): "
            f"{fam.refused}. Distillation and training still run; serve it without a draft"
        )


def exact_dtype(engine: str, dtype: str) -> bool:
    """Whether `engine` decodes a target in `dtype` exactly (speculative output equal to plain
    greedy)."""
    return dtype in EXACT_DTYPES["static" if engine == "compiled" else engine]


def attention_for(config: Any) -> Optional[str]:
    """The attn_implementation `auto` means for this target where the table knows it, else None (the
    loader asks the model class)."""
    cfg = config_dict(config)
    fam = _BY_TYPE.get(str(cfg.get("model_type")))
    return fam.attention if fam is not None else None


def markdown() -> str:
    """docs/targets.md: the table as a newcomer reads it."""
    intro = (
        "Written from `target/families.py` (`python -m headway.target.families > docs/targets.md`); every "
        "command reads that table from the target's config.json before the model loads. "
        "`inference.engine=auto` picks the CUDA backend on a GPU where it runs the family, else the static "
        "engine where it does, else the hf engine (the model's own forward through transformers). "
        "`target.dtype=auto` picks the fastest format exact on that engine: on the hf engine that is "
        "float32, because a tree's rows and a single row round differently there in bf16. An explicit dtype "
        "that the engine cannot run exactly is decoded as asked, with a one-line warning."
    )
    outro = (
        "Whatever the family: rope types whose tables rescale with the sequence length (`dynamic`, "
        "`longrope`) run on the hf engine only; a sliding window rules out the static engine (and the CUDA "
        "backend, but for Gemma-3). A family not in the table runs through transformers on the hf engine, in "
        "float32, unless its `layer_types` name a recurrent layer, which is refused in one line. EAGLE "
        'exports "written" are checked key by key against the engines\' loaders; whether an engine hands '
        "a family's hidden states to an EAGLE draft is the engine's own (vLLM: the target classes "
        "implementing SupportsEagle3)."
    )
    lines = [
        "# Targets: the families Headway runs",
        "",
        intro,
        "",
        "| family | model_type | engines (exact) | attention (`auto`) | EAGLE exports | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in FAMILIES:
        engines = ", ".join(f.engines) if f.engines else "refused"
        served = "refused" if f.unserved or f.refused else "written"
        notes = "; ".join([*f.notes, *filter(None, (f.refused, f.unserved))])
        types = ", ".join(f"`{t}`" for t in f.model_types)
        lines.append(f"| {f.name} | {types} | {engines} | {f.attention} | {served} | {notes} |")
    lines += ["", outro, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
