"""CUDA graphs for the CUDA backend's steps: one graph per row bucket, captured lazily after warm-up, replayed
after; an eager fallback wherever capture is off or fails.

As SGLang's graph runners do: a bucket's step runs eagerly for its first `WARMUP` calls (so cuBLAS, the
allocator and any lazy kernel setup finish outside capture), on a side stream, then is captured with
`torch.cuda.graph` into a memory pool every bucket shares, and replayed from then on. The step reads only the
runner's persistent buffers, so a replay computes the current step; its outputs live in the graph's pool and
are overwritten by the next replay. Capture time and memory are logged per bucket and kept in `stats`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

# eager runs of a bucket's step before it is captured
WARMUP = 2


class StepGraphs:
    """`run(m)` = `step(m)`, through bucket m's CUDA graph once captured.

    Args:
        step: the bucket step, reading only persistent buffers; device: where it runs; enabled: capture graphs
            (None: on CUDA; never elsewhere, where `run` is `step`)."""

    def __init__(self, step: Callable[[int], Any], device: torch.device, enabled: Optional[bool] = None):
        self.step = step
        self.requested = enabled
        self.enabled = device.type == "cuda" if enabled is None else enabled and device.type == "cuda"
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self.calls: dict[int, int] = {}
        self.failed: set[int] = set()
        self.stats: dict[int, dict] = {}  # per bucket: capture seconds and pool bytes
        self.pool: Any = None

    def run(self, m: int) -> Any:
        if not self.enabled or m in self.failed:
            return self.step(m)
        if m in self.graphs:
            graph, out = self.graphs[m]
            graph.replay()
            return out
        self.calls[m] = self.calls.get(m, 0) + 1
        if self.calls[m] <= WARMUP:
            return self._warm(m)
        return self._capture(m)

    def _warm(self, m: int) -> Any:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.step(m)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, m: int) -> Any:
        torch.cuda.synchronize()
        before, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.step(m)
        except Exception as e:  # capture is an optimisation: the eager step stays exact
            log.warning("CUDA graph capture of the %d-row step failed (%s); that bucket runs eagerly", m, e)
            self.failed.add(m)
            torch.cuda.synchronize()
            return self.step(m)
        graph.replay()
        torch.cuda.synchronize()
        self.stats[m] = {
            "capture_s": time.perf_counter() - t0,
            "pool_bytes": torch.cuda.memory_reserved() - before,
        }
        log.info(
            "captured the %d-row step as a CUDA graph in %.2f s (%.1f MiB)",
            m,
            self.stats[m]["capture_s"],
            self.stats[m]["pool_bytes"] / 2**20,
        )
        self.graphs[m] = (graph, out)
        return out
