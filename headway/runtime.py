"""Process-level settings every command shares: distributed rank, thread count, device, dtype."""

from __future__ import annotations

import functools
import logging
import os

import torch

from headway.config import DTYPE_NAMES
from headway.errors import HeadwayError
from headway.ranks import DistInfo, dist_info

log = logging.getLogger("headway")

DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


def barrier(info: DistInfo) -> None:
    """Wait for every rank of a launched job (no-op for one process)."""
    if info.world_size > 1:
        torch.distributed.barrier()


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise HeadwayError(
            f"unknown dtype '{name}': use one of float32, bfloat16, float16, float64"
        ) from None


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present (this process's local rank's GPU), else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_info().local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise HeadwayError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HeadwayError(
            f"device '{name}' asked for, but this machine has no CUDA GPU: use device=cpu or auto"
        )
    return device


def resolve_threads(num_threads: int) -> int:
    """The thread count a `target.num_threads` setting means: itself, or (0) the machine's cores
    shared evenly by this node's processes."""
    if num_threads <= 0:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
        num_threads = max(1, cores // max(1, dist_info().local_world_size))
    return num_threads


def configure_threads(num_threads: int) -> int:
    """Pin torch's intra-op threads (`resolve_threads`) and return how many.

    On a small CPU, oversubscribed threads make every run many times slower, so this is always set.
    """
    num_threads = resolve_threads(num_threads)
    torch.set_num_threads(num_threads)
    return num_threads


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> tuple[str, ...] | None:
    """The CPU's feature flags from /proc/cpuinfo (read once), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return None


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 math is native here: any CUDA GPU, or a CPU with AVX512_BF16 or AMX (AVX2-only
    CPUs emulate bf16 several times slower than float32)."""
    if torch.device(device).type == "cuda":
        return True
    flags = _cpu_flags()
    if flags is None:
        capability = torch.backends.cpu.get_cpu_capability()
        return "BF16" in capability or "AMX" in capability
    return "avx512_bf16" in flags or "amx_bf16" in flags


def amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles, where a product's rows beside the first cost
    little."""
    flags = _cpu_flags()
    return flags is not None and "amx_bf16" in flags


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 where it is native (see native_bf16), else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return parse_dtype(name)
