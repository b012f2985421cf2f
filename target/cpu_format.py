"""The fastest exact format a CPU decodes a target in: what `target.dtype=auto` (the default) means
for every decoding command.

On the static engine every CPU format Headway decodes in keeps speculative decoding equal to that
format's plain decoding, so the choice is one of speed only (docs/bench-kernels.md has the figures
behind it). On the hf engine (families the static engine does not run: target/families.py) only
float32 is exact, so `auto` is float32 there, with a line saying why. A dtype set explicitly is
decoded as set (with a warning where the engine cannot decode it exactly), and training,
distillation and GPU decoding resolve `auto` as float32 (TargetConfig.as_loaded).
"""

from __future__ import annotations

import dataclasses

import torch

from headway.runtime import amx_bf16, resolve_device, resolve_threads
from headway.target.config import TargetConfig
from headway.target.families import exact_dtype
from headway.target.packed_capability import kernels_missing

OPT_OUT = "target.dtype=float32"


def may_stream(cfg: TargetConfig) -> bool:
    """Whether decoding with `cfg` may run Headway's streaming linear: set as target.linear_weights,
    or left to `fastest_cpu_format`, which picks it on CPUs without AMX. A caller builds the kernel
    early on that answer (it only costs compile time where the policy then picks another format)."""
    if resolve_device(cfg.device).type != "cpu":
        return False
    if cfg.linear_weights == "stream":
        return True
    return cfg.dtype == "auto" and cfg.linear_weights == "auto" and not amx_bf16()


def decoding_format(
    cfg: TargetConfig, engine: str, family: str = "this"
) -> tuple[TargetConfig, str, str]:
    """The target settings `engine` decodes exactly, a line saying why they were chosen, and a
    warning where the user asked for a dtype that engine cannot decode exactly (decoded as asked).

    Args:
        cfg: the target section as the user left it; engine: the engine that will run it (static,
            compiled, cuda or hf: target/families.choose_engine); family: the family's name, for the
            messages.
    Returns:
        (resolved settings, why, warning); why and warning are "" where there is nothing to say.
    """
    if engine != "hf":
        resolved, why = fastest_cpu_format(cfg)
        return resolved, why, ""
    if cfg.dtype == "auto":
        why = (
            f"the hf engine runs {family} target (the static engine does not run its family): decoding it in "
            "float32, the format exact there (in bf16 a tree's rows and a single row round differently)"
        )
        return cfg.as_loaded(), why, ""
    resolved = cfg.as_loaded()
    if exact_dtype(engine, resolved.dtype):
        return resolved, "", ""
    warning = (
        f"target.dtype={resolved.dtype} on the hf engine is not exact: a tree's rows and a single row round "
        "differently, so speculative output can part from plain greedy decoding at near-ties; decoding as "
        "asked (target.dtype=auto decodes exactly)"
    )
    return resolved, "", warning


def fastest_cpu_format(cfg: TargetConfig) -> tuple[TargetConfig, str]:
    """The target settings to decode with, and a line saying why (empty where nothing changed).

    On CPUs with oneDNN's bf16 kernels: bf16, with oneDNN-packed weights on AMX (a tree's rows
    beside the first cost little), else through Headway's AVX512-BF16 streaming linear (the fastest
    step and cheapest tree rows there), or where it cannot build, float16-packed weights (fbgemm's
    one-row kernel). On other
    CPUs (AVX2): bf16 through the streaming linear's AVX2 build, else float32 through it, or where
        it cannot
    run, float32 with oneDNN-packed weights (one-row steps that use every thread), MKL-packed on one
    thread.

    Args:
        cfg: the target section as the user left it.
    Returns:
        (cfg with dtype and linear_weights resolved, the reason to print): as a plain load resolves
        them (cfg.as_loaded(), no reason) where dtype or linear_weights were set, the device is not
        a CPU, or torch has no oneDNN kernels.
    """
    if (
        cfg.dtype != "auto"
        or cfg.linear_weights != "auto"
        or resolve_device(cfg.device).type != "cpu"
        or kernels_missing("onednn", torch.float32)
    ):
        return cfg.as_loaded(), ""
    if kernels_missing("onednn", torch.bfloat16):
        if not kernels_missing("stream", torch.bfloat16):
            why = (
                "no oneDNN bf16 kernels on this CPU: decoding the target in bf16 through the AVX2 build of "
                f"Headway's streaming linear, half the float32 format's bytes ({OPT_OUT}: float32 as "
                "loaded)"
            )
            return dataclasses.replace(cfg, dtype="bfloat16", linear_weights="stream"), why
        if not kernels_missing("stream", torch.float32):
            why = (
                "no oneDNN bf16 kernels on this CPU: decoding the target in float32 through Headway's "
                f"streaming linear ({OPT_OUT}: float32 as loaded)"
            )
            return dataclasses.replace(cfg, dtype="float32", linear_weights="stream"), why
        # one thread: MKL's packed sgemm streams a one-token step's weights fastest; oneDNN's uses
        # more threads
        packed = (
            "mkl"
            if resolve_threads(cfg.num_threads) == 1 and not kernels_missing("mkl")
            else "onednn"
        )
        why = (
            "no oneDNN bf16 kernels on this CPU: decoding the target in float32 with weights prepacked for "
            f"{'MKL' if packed == 'mkl' else 'oneDNN'} ({OPT_OUT}: float32 as loaded)"
        )
        return dataclasses.replace(cfg, dtype="float32", linear_weights=packed), why
    if not amx_bf16() and not kernels_missing("stream", torch.bfloat16):
        why = (
            "this CPU has bf16 instructions without AMX: decoding the target in bf16 through Headway's "
            "AVX512-BF16 streaming linear, the fastest step and cheapest tree rows here "
            f"({OPT_OUT}: float32 as loaded)"
        )
        return dataclasses.replace(cfg, dtype="bfloat16", linear_weights="stream"), why
    if amx_bf16() or kernels_missing("float16", torch.bfloat16):
        why = (
            "this CPU has oneDNN bf16 kernels: decoding the target in bf16 with prepacked weights "
            f"({OPT_OUT}: float32 as loaded)"
        )
        return dataclasses.replace(cfg, dtype="bfloat16", linear_weights="onednn"), why
    why = (
        "this CPU has bf16 instructions without AMX: decoding the target in bf16 with its weights packed as "
        f"float16 for fbgemm, the fastest one-token step here ({OPT_OUT}: float32 as loaded)"
    )
    return dataclasses.replace(cfg, dtype="bfloat16", linear_weights="float16"), why
