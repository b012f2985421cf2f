"""Typed run configs: dataclass schemas, a YAML file, `key=value` overrides, unknown keys refused.

Every command loads its config through `load_config`, so a misspelt key anywhere (file or command
line) stops the run with a message that names the key and the nearest valid one.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from headway.errors import HeadwayError
from headway.io import atomic_write_text

T = TypeVar("T")

log = logging.getLogger("headway")

CONFIG_FILENAME = "config.yaml"
# The dtype names configs accept, and the torch dtype each means (headway/runtime.py maps them to
# torch's).
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float64": "float64",
    "fp64": "float64",
}


def _valid_keys(schema: type, dotted: str) -> list[str]:
    """The keys a schema accepts at the level of `dotted` (for the error message)."""
    node: Any = schema()
    for part in dotted.split(".")[:-1]:
        node = getattr(node, part, None)
    return [f.name for f in fields(node)] if is_dataclass(node) else []


def _unknown_key_error(schema: type, exc: OmegaConfBaseException, source: str) -> HeadwayError:
    key = getattr(exc, "full_key", None) or str(exc)
    valid = _valid_keys(schema, key) if key else []
    leaf = key.split(".")[-1]
    hint = difflib.get_close_matches(leaf, valid, n=1)
    msg = f"unknown config key '{key}' in {source}"
    if hint:
        msg += f": did you mean '{'.'.join(key.split('.')[:-1] + [hint[0]])}'?"
    if valid:
        msg += f" (valid keys here: {', '.join(valid)})"
    return HeadwayError(msg)


def _section_of(layer: DictConfig, key: str) -> tuple[Any, str]:
    """The section of `layer` that holds the dotted `key` (None where the layer has no such
    section), and its name there."""
    *path, leaf = key.split(".")
    node: Any = layer
    for part in path:
        node = node.get(part) if isinstance(node, DictConfig) and part in node else None
    return (node if isinstance(node, DictConfig) else None), leaf


def _rename_old_keys(schema: DictConfig, layer: DictConfig, source: str, prefix: str = "") -> None:
    """Read the keys a config section renamed (the RENAMED_KEYS class attribute of its dataclass:
    old -> new, dotted paths within the section, so that a key may also move to another sub-section,
    with the issue that renamed them) as the new ones, in place, so that configs saved before keep
    loading; a layer that sets both is an error. schema: the structured config `layer` is merged
    into."""
    for old, new in getattr(OmegaConf.get_type(schema), "RENAMED_KEYS", {}).items():
        section, leaf = _section_of(layer, old)
        if section is not None and leaf in section:
            there, new_leaf = _section_of(layer, new)
            if there is not None and new_leaf in there:
                raise HeadwayError(
                    f"{source} sets both {prefix}{old} and {prefix}{new}: keep {prefix}{new}"
                )
            log.warning(
                "%s: %s%s was renamed %s%s; reading it as that", source, prefix, old, prefix, new
            )
            OmegaConf.update(layer, new, section.pop(leaf), merge=False)
    for key, value in layer.items_ex(resolve=False):
        section = schema.get(key) if isinstance(value, DictConfig) else None
        if isinstance(section, DictConfig):
            _rename_old_keys(section, value, source, f"{prefix}{key}.")


def read_renamed_keys(schema: type, layer: DictConfig, source: str) -> DictConfig:
    """`layer` (a config file, such as a run's saved config.yaml) with the keys `schema` renamed
    read as the new ones, as load_config reads them (in place)."""
    _rename_old_keys(OmegaConf.structured(schema), layer, source)
    return layer


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def load_config(
    schema: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> T:
    """Build a `schema` instance from its defaults, then the YAML file, then `key=value`
    overrides."""
    base = OmegaConf.structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise HeadwayError(f"config file not found: {p}")
        try:
            loaded = OmegaConf.load(p)
        except Exception as e:  # yaml syntax errors come in many types
            raise HeadwayError(f"cannot parse config file {p}: {e}") from None
        if not isinstance(loaded, DictConfig):
            raise HeadwayError(
                f"config file {p} must hold a mapping of sections, not a {type(loaded).__name__}"
            )
        layers.append((str(p), loaded))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise HeadwayError(
            f"override '{bad[0]}' is not of the form key=value (e.g. distill.max_new_tokens=128)"
        )
    for o in overrides:
        try:
            OmegaConf.from_dotlist([o])
        except Exception as e:  # yaml and omegaconf grammar errors come in many types
            raise HeadwayError(
                f"cannot parse override '{o}' ({_first_line(e)}): quote the value or fix its syntax"
            ) from None
    if overrides:
        try:
            layers.append(("the command line", OmegaConf.from_dotlist(list(overrides))))
        # e.g. `train=1 train.lr=2`: a key set both as a value and as a section
        except Exception as e:
            raise HeadwayError(
                f"the overrides {' '.join(overrides)} contradict each other ({_first_line(e)})"
            ) from None
    cfg = base
    for source, layer in layers:
        _rename_old_keys(base, layer, source)
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except (ConfigKeyError, ConfigAttributeError) as e:
            raise _unknown_key_error(schema, e, source) from None
        except ValidationError as e:
            raise HeadwayError(
                f"bad value for config key '{e.full_key}' in {source}: {e.msg}"
            ) from None
        # a list given a mapping, and the like
        except (OmegaConfBaseException, TypeError, ValueError) as e:
            key = getattr(e, "full_key", "") or ""
            raise HeadwayError(
                f"bad value{f' for config key {key!r}' if key else ''} in {source}: {_first_line(e)}"
            ) from None
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise HeadwayError(
            f"config error at '{getattr(e, 'full_key', '')}': {getattr(e, 'msg', e)}"
        ) from None


def config_to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, directory: str | os.PathLike, filename: str = CONFIG_FILENAME) -> Path:
    """Write the resolved config beside a run's outputs, so the run can be reproduced."""
    path = Path(directory) / filename
    atomic_write_text(path, config_to_yaml(cfg))
    return path


def check_choice(section: str, key: str, value: str, choices: Sequence[str]) -> None:
    """Validate a string field limited to a few values (OmegaConf has no Literal support)."""
    if value not in choices:
        raise HeadwayError(
            f"{section}.{key}='{value}' is not allowed: use one of {', '.join(choices)}"
        )
