"""CUDA graphs for the CUDA backend's steps: one graph per row bucket, captured lazily after
warm-up, replayed after; an eager fallback wherever capture is off or fails.

As SGLang's graph runners do: a bucket's step runs eagerly for its first `WARMUP` calls (so cuBLAS,
the allocator and any lazy kernel setup finish outside capture), on a side stream, then is captured
with `torch.cuda.graph` into a memory pool every bucket shares, and replayed from then on. The step
reads only the runner's persistent buffers, so a replay computes the current step; its outputs live
in the graph's pool and are overwritten by the next replay. Capture time and memory are logged per
bucket and kept in `stats`.

What a real GPU adds, and each capture does about it (docs/inference.md, "The CUDA path on
hardware"):
- the device: warm-up, capture and replay run under `torch.cuda.device(device)`, on streams made for
  that device, so a runner on `cuda:1` captures its own kernels when device 0 is current (else the
  graph records nothing and every replay is a no-op);
- Python's garbage collector: since torch 2.9 `torch.cuda.graph` no longer collects before
  capturing, and a collection inside it that destroys an older graph invalidates the capture; a
  capture collects first and runs with the collector off. The step is held by a weak reference, so a
  runner and its graphs form no cycle and go as soon as the runner does;
- a failed capture: the stream that was current is made current again (torch's `graph.__exit__` ends
  the capture before it restores the stream, so a raising `capture_end` would leave the capture
  stream current), and the failure is counted (`failures`, `stats`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

log = logging.getLogger(__name__)

# eager runs of a bucket's step before it is captured
WARMUP = 2


class StepGraphs:
    """`run(m)` = `step(m)`, through bucket m's CUDA graph once captured.

    Args:
        step: the bucket step, reading only persistent buffers; device: where it runs; enabled:
            capture graphs (None: on CUDA; never elsewhere, where `run` is `step`)."""

    def __init__(
        self, step: Callable[[int], Any], device: torch.device, enabled: Optional[bool] = None
    ):
        # a bound method is held weakly: the runner owns its graphs, and the graphs must not keep it
        # alive
        self._step: Callable[[], Optional[Callable[[int], Any]]] = (
            weakref.WeakMethod(step) if hasattr(step, "__self__") else (lambda: step)
        )
        self.device = torch.device(device)
        self.requested = enabled
        self.enabled = (
            device.type == "cuda" if enabled is None else enabled and device.type == "cuda"
        )
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self.calls: dict[int, int] = {}
        self.failed: set[int] = set()
        # per bucket: capture seconds and pool bytes, or the failure
        self.stats: dict[int, dict] = {}
        self.failures = 0  # captures that failed (their buckets run eagerly)
        self.pool: Any = None
        self._stream: Any = None

    def step(self, m: int) -> Any:
        """Bucket m's step, eagerly."""
        step = self._step()
        if step is None:
            raise RuntimeError("internal: the runner these graphs step was freed")
        return step(m)

    def run(self, m: int) -> Any:
        if not self.enabled or m in self.failed:
            return self.step(m)
        with torch.cuda.device(self.device):
            if m in self.graphs:
                graph, out = self.graphs[m]
                graph.replay()
                return out
            self.calls[m] = self.calls.get(m, 0) + 1
            if self.calls[m] <= WARMUP:
                return self._warm(m)
            return self._capture(m)

    def _warm(self, m: int) -> Any:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out = self.step(m)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return out

    def _capture(self, m: int) -> Any:
        torch.cuda.synchronize(self.device)
        # (torch.cuda.graph empties the cache on entry: do it first, so the pool's growth is
        # measured from it)
        torch.cuda.empty_cache()
        before, t0 = torch.cuda.memory_reserved(self.device), time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        try:
            with (
                no_collection(),
                torch.cuda.graph(graph, pool=self.pool, stream=self._capture_stream()),
            ):
                out = self.step(m)
        except Exception as e:  # capture is an optimisation: the eager step stays exact
            # (a failed capture_end leaves the capture stream current)
            torch.cuda.set_stream(current)
            log.warning(
                "CUDA graph capture of the %d-row step failed (%s); that bucket runs eagerly", m, e
            )
            self.failed.add(m)
            self.failures += 1
            self.stats[m] = {"failed": str(e).splitlines()[0] if str(e) else type(e).__name__}
            torch.cuda.synchronize(self.device)
            return self.step(m)
        graph.replay()
        torch.cuda.synchronize(self.device)
        self.stats[m] = {
            "capture_s": time.perf_counter() - t0,
            "pool_bytes": max(0, torch.cuda.memory_reserved(self.device) - before),
        }
        log.info(
            "captured the %d-row step as a CUDA graph in %.2f s (%.1f MiB)",
            m,
            self.stats[m]["capture_s"],
            self.stats[m]["pool_bytes"] / 2**20,
        )
        self.graphs[m] = (graph, out)
        return out

    def _capture_stream(self) -> Any:
        """The side stream captures run on, made for this device (torch.cuda.graph's own default
        stream is made on the current device)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def reset(self) -> None:
        """Drop every captured graph and its outputs (the runner is closing or changing its step):
        they are freed now, not by a later collection that might run inside another capture."""
        self.graphs.clear()
        self.calls.clear()
        self.pool = None


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Collect garbage now, then keep the collector off until the block ends (and restore its
    state): a collection inside a CUDA graph capture that frees another graph invalidates the
    capture (torch >= 2.9 no longer collects before capturing; vLLM and SGLang freeze the collector
    around capture too)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
