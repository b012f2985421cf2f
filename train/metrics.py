"""Training figures kept on the device until a log step reads them, and the run's throughput.

A training step reads nothing back to the host: its loss, metrics and gradient norm stay 0-dim
device tensors. Every `train.log_every` steps `read` averages them across ranks in one all-reduce of
one stacked tensor and reads that back with one `tolist()`: the only host read of the loop outside
the finite-loss check (train/step.py) and evaluation.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from headway.train.distributed import Parallel
from headway.train.losses import COUNT

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of torch.cuda.get_device_name,
# for MFU when train.peak_tflops is 0 (auto). Longest names first: "H100 PCIe" before "H100".
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


class MetricSums:
    """Metrics summed over micro-batches as (sum, count) pairs on the device: a metric with a row
    count (`name` and `name#n`, train/losses.py `counted`) adds mean x count and count, any other
    adds itself and 1 (the loss, a gradient norm: a mean per micro-batch)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, v in metrics.items():
            if key.endswith(COUNT):
                continue
            v = torch.as_tensor(v).float()
            n = metrics.get(key + COUNT)
            n = torch.ones_like(v) if n is None else n.float().reshape(v.shape)
            s = v * n if key + COUNT in metrics else v
            self.sums[key] = s if key not in self.sums else self.sums[key] + s
            self.counts[key] = n if key not in self.counts else self.counts[key] + n

    def values(self) -> dict[str, torch.Tensor]:
        """name -> [2] (sum, count) device tensor, what `read` takes."""
        return {k: torch.stack([self.sums[k], self.counts[k]]) for k in self.sums}


def read(values: dict[str, torch.Tensor], par: Parallel) -> dict[str, float]:
    """Each metric averaged over micro-batches and ranks as its sum over its count, read to the host
    at once (one all-reduce of one stacked tensor: a collective, the same keys on every rank).
    values: name -> a [2] (sum, count) tensor (`MetricSums`), or a 0-dim value counted once (a
        rank's mean)."""
    if not values:
        return {}
    keys = sorted(values)
    pairs = []
    for k in keys:
        v = torch.as_tensor(values[k], device=par.device).float()
        pairs.append(v if v.dim() else torch.stack([v, torch.ones_like(v)]))
    total = par.sum(torch.stack(pairs))  # [keys, 2]
    means = torch.where(
        total[:, 1] > 0, total[:, 0] / total[:, 1].clamp(min=1e-30), torch.zeros_like(total[:, 0])
    )
    return dict(zip(keys, means.tolist()))


def peak_flops(device: torch.device, peak_tflops: float) -> Optional[float]:
    """FLOP/s of 100% MFU: train.peak_tflops when set, else the GPU's dense bf16 peak when known;
    None (no MFU logged) on CPUs and unknown GPUs."""
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
    """Answer tokens and model FLOPs per second between log steps: timed by CUDA events on GPUs (the
    time the device spent, read when the log step synchronises anyway), by the wall clock on
    CPUs."""

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
        """One step's global answer tokens and model FLOPs (host numbers, from the batch's
        shapes)."""
        self.tokens += tokens
        self.flops += flops

    def read(self) -> dict[str, float]:
        """tokens_per_s, tflops_per_s and (with a known peak) mfu since the last read; restarts the
        count."""
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
