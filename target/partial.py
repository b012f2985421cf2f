"""The part of a target that training from cached features reads: its input embedding, its final
norm and its lm_head (and its config), loaded without the decoder layers.

Offline (train.features_dir), a head never runs the target: its objective recomputes the target's
logits from the cached last hidden state through the lm_head (with the family's final soft-capping,
read from the config), and the head kinds share or copy the embedding, the final norm and the
lm_head when they are built. `load_partial_target` reads just those tensors from the checkpoint's
safetensors (`safe_open(...).get_tensor(name)`; a sharded checkpoint's files found through its index
json) into a `PartialCausalLM`, which offers what training asks of the target model and nothing
else, so a rank holds those tensors and no decoder layer.

Its modules are the family's own, taken from the model built from the target's config with its
parameters on the meta device (no memory, no initialisation) and its buffers as computed (a scaled
embedding's scale): a Gemma embedding scales and a (1 + w) norm is one, as in the whole model. Tied
embeddings stay one tensor. A checkpoint whose names do not match the model's (a layout transformers
renames on load) loads the whole target instead, with a warning.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from headway.errors import HeadwayError
from headway.runtime import configure_threads, parse_dtype, resolve_device
from headway.target.config import TargetConfig
from headway.target.loading import (
    Target,
    _experts_implementation,
    attention_implementation,
    compute_fingerprint,
    load_target,
    resolve_target_dir,
    target_files,
)

log = logging.getLogger("headway")

# the decoder layers to load beside the embedding, norm and lm_head: indices, or a function of the
# target's config giving them (a head that starts as a copy of a target layer)
Layers = Union[Sequence[int], Callable[[Any], Sequence[int]]]


class _Body(nn.Module):
    """The base model's part that is kept: `embed_tokens`, `norm` (where the family has one there)
    and `layers`, with a placeholder for every decoder layer that is not loaded."""


class PartialCausalLM(nn.Module):
    """What training reads of a target model offline: get_input_embeddings(),
    get_output_embeddings(), `model.norm`, `config`, `lm_head` and get_decoder().layers (only the
    layers asked for are real); it has no forward."""

    def __init__(self, config: Any, body: _Body, lm_head: nn.Module):
        super().__init__()
        self.config = config
        self.model = body
        self.lm_head = lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> nn.Module:
        return self.model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise HeadwayError(
            "this target was loaded for training from cached features: it holds its embedding, final "
            "norm and lm_head only, and cannot run"
        )


class _Mismatch(Exception):
    """The checkpoint's tensors do not match the model's names or shapes."""


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no memory, no initialisation
    cost) and their buffers as their constructors compute them."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index json of a sharded checkpoint,
    else from the headers of the directory's safetensors files (no tensor is read)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), file))
    return found


def _tied_keys(skeleton: Any) -> dict[str, str]:
    """The model's tied parameters, tied name -> source name (the lm_head's weight -> the
    embedding's, where the embeddings are tied)."""
    keys = getattr(skeleton, "all_tied_weights_keys", None)
    if isinstance(keys, dict):  # transformers 5
        return dict(keys)
    config = skeleton.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    names = {id(m): n for n, m in skeleton.named_modules(remove_duplicate=False)}
    source = names.get(id(skeleton.get_input_embeddings()))
    tied = names.get(id(skeleton.get_output_embeddings()))
    return {f"{tied}.weight": f"{source}.weight"} if source and tied else {}


def _kept_in_float32(skeleton: Any, dtype: torch.dtype, name: str) -> bool:
    """Whether transformers keeps this parameter in float32 at `dtype` (_keep_in_fp32_modules)."""
    plan = skeleton._get_dtype_plan(dtype) if hasattr(skeleton, "_get_dtype_plan") else {}
    return any(re.search(rf"(^|\.){re.escape(key)}($|\.)", name) for key in plan)


def _build_skeleton(path: Path, config: Any, cfg: TargetConfig, attn: Optional[str]) -> Any:
    """The target's model class built from its config with its parameters on the meta device."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(
            config,
            dtype=parse_dtype(cfg.dtype),
            attn_implementation=attn,
            trust_remote_code=cfg.trust_remote_code,
            **_experts_implementation(config, cfg.dtype),
        )


def partial_model(
    path: Path,
    config: Any,
    cfg: TargetConfig,
    attn: Optional[str],
    device: torch.device,
    layers: Layers = (),
) -> tuple[PartialCausalLM, int]:
    """(the partial model on `device`, the whole model's parameter bytes).

    Raises:
        _Mismatch: a tensor the partial model needs is not in the checkpoint, or has another shape.
    """
    from safetensors import safe_open

    skeleton = _build_skeleton(path, config, cfg, attn)
    dtype = parse_dtype(cfg.dtype)
    whole = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    names = {id(m): n for n, m in skeleton.named_modules(remove_duplicate=False)}
    embed, lm_head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    base = getattr(skeleton, "model", None)
    norm = getattr(base, "norm", None) if isinstance(base, nn.Module) else None
    decoder = skeleton.get_decoder() if hasattr(skeleton, "get_decoder") else None
    all_layers = getattr(decoder, "layers", None)
    wanted = []
    if isinstance(all_layers, nn.ModuleList):
        asked = layers(skeleton.config) if callable(layers) else layers
        wanted = sorted({i for i in asked if 0 <= i < len(all_layers)})
    kept: list[nn.Module] = [embed, lm_head, *([norm] if norm is not None else [])]
    kept += [all_layers[i] for i in wanted]
    if embed is None or lm_head is None or any(id(m) not in names for m in kept):
        raise _Mismatch("the model names no input or output embedding")
    files = checkpoint_files(path)
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    tied = _tied_keys(skeleton)
    loaded: dict[str, nn.Parameter] = {}
    handles: dict[Path, Any] = {}

    def read(name: str, like: torch.Tensor) -> nn.Parameter:
        stored = name
        if stored not in files and prefix and stored.startswith(prefix + "."):
            stored = stored[len(prefix) + 1 :]  # a base model's checkpoint
        if stored not in files:
            raise _Mismatch(f"{name} is not in the checkpoint")
        file = files[stored]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device=str(device))
        tensor = handles[file].get_tensor(stored)
        if tuple(tensor.shape) != tuple(like.shape):
            raise _Mismatch(f"{name} is {tuple(tensor.shape)} in the checkpoint")
        if tensor.is_floating_point():
            kept32 = _kept_in_float32(skeleton, dtype, name)
            tensor = tensor.to(torch.float32 if kept32 else dtype)
        return nn.Parameter(tensor, requires_grad=False)

    wanted_params = [
        (module, local, f"{names[id(module)]}.{local}")
        for module in kept
        for local, _ in module.named_parameters(remove_duplicate=False)
    ]
    for _, _, name in sorted(wanted_params, key=lambda w: w[2] in tied):  # sources first
        if name in loaded:
            continue
        source = tied.get(name)
        if source is not None:
            if source not in loaded:
                loaded[source] = read(source, skeleton.get_parameter(source))
            loaded[name] = loaded[source]
        else:
            loaded[name] = read(name, skeleton.get_parameter(name))
    for module, local, name in wanted_params:
        owner_name, _, leaf = local.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[leaf] = loaded[name]
    body = _Body()
    body.embed_tokens = embed
    if norm is not None:
        body.norm = norm
    if isinstance(all_layers, nn.ModuleList):
        body.layers = nn.ModuleList(
            [all_layers[i] if i in wanted else nn.Identity() for i in range(len(all_layers))]
        )
    model = PartialCausalLM(skeleton.config, body, lm_head).to(device)  # (the buffers)
    model.eval()
    model.requires_grad_(False)
    return model, whole


def held_bytes(model: nn.Module) -> int:
    """The bytes of a model's parameters and buffers, each tensor counted once."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr() if t.device.type != "meta" else id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def load_partial_target(cfg: TargetConfig, layers: Layers = ()) -> Target:
    """The target as training from cached features needs it: tokenizer, config, fingerprint and a
    `PartialCausalLM` holding only the embedding, the final norm and the lm_head (plus the decoder
    `layers` asked for), read from the checkpoint's safetensors onto target.device in target.dtype.
    A checkpoint that does not name those tensors as the model does loads the whole target (with a
    warning)."""
    cfg = cfg.as_loaded()
    threads = configure_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    path = resolve_target_dir(cfg)
    config, tokenizer, gen_config = target_files(path, cfg.trust_remote_code)
    attn = attention_implementation(cfg.attn_implementation, config)
    try:
        model, whole = partial_model(Path(path), config, cfg, attn, device, layers)
    except _Mismatch as e:
        log.warning(
            "target %s: cannot read its embedding, final norm and lm_head alone (%s); loading the "
            "whole target",
            cfg.name_or_path,
            e,
        )
        return load_target(cfg)
    log.info(
        "target %s: its embedding, final norm and lm_head only (%d of its %d parameter bytes, %s, "
        "%s): training reads cached features",
        cfg.name_or_path,
        held_bytes(model),
        whole,
        cfg.dtype,
        device,
    )
    return Target(
        model=model,
        tokenizer=tokenizer,
        path=Path(path),
        fingerprint=compute_fingerprint(model.config, tokenizer),
        config=model.config,
        generation_config=gen_config,
        num_threads=threads,
        settings=cfg,
    )
