"""Training figures kept on the device until a log step reads them, and the run's throughput.

A training step reads nothing back to the host: its loss, metrics and gradient norm stay 0-dim device tensors.
Every `train.log_every` steps `read` averages them across ranks in one all-reduce of one stacked tensor and
reads that back with one `tolist()`: the only host read of the loop outside the finite-loss check
(train/step.py) and evaluation.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from headway.train.distributed import Parallel

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of torch.cuda.get_device_name, for
# MFU when train.peak_tflops is 0 (auto). Longest names first: "H100 PCIe" before "H100".
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "H20": 148.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A10G": 70.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def read(values: dict[str, torch.Tensor], par: Parallel) -> dict[str, float]:
    """The mean over ranks of each 0-dim device tensor, read to the host at once (a collective)."""
    if not values:
        return {}
    averaged = par.mean(values)
    keys = sorted(averaged)
    numbers = torch.stack([averaged[k] for k in keys]).tolist()
    return dict(zip(keys, numbers))


def peak_flops(device: torch.device, peak_tflops: float) -> Optional[float]:
    """FLOP/s of 100% MFU: train.peak_tflops when set, else the GPU's dense bf16 peak when known; None (no MFU
    logged) on CPUs and unknown GPUs."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


class Throughput:
    """Answer tokens and model FLOPs per second between log steps: timed by CUDA events on GPUs (the time the
    device spent, read when the log step synchronises anyway), by the wall clock on CPUs."""

    def __init__(self, device: torch.device, peak: Optional[float]):
        self.cuda = device.type == "cuda"
        self.peak = peak
        self.tokens, self.flops = 0, 0.0
        self._start = self._mark()

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, tokens: int, flops: float) -> None:
        """One step's global answer tokens and model FLOPs (host numbers, from the batch's shapes)."""
        self.tokens += tokens
        self.flops += flops

    def read(self) -> dict[str, float]:
        """tokens_per_s, tflops_per_s and (with a known peak) mfu since the last read; restarts the count."""
        end = self._mark()
        if self.cuda:
            end.synchronize()
            seconds = self._start.elapsed_time(end) / 1000
        else:
            seconds = end - self._start
        seconds = max(seconds, 1e-9)
        out = {"tokens_per_s": self.tokens / seconds, "tflops_per_s": self.flops / seconds / 1e12}
        if self.peak:
            out["mfu"] = self.flops / seconds / self.peak
        self.tokens, self.flops, self._start = 0, 0.0, end
        return out
