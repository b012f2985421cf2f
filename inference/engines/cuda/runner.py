"""The CUDA backend of the static engine (`inference.engine=cuda`): every decoding step is one
bucketed step over persistent buffers, shaped for CUDA graphs.

gpt-fast, SGLang's graph runners and vLLM's persistent buffers are the models:
- a fixed cache length (`max_len` + one scratch slot that pad rows write) and a few row buckets;
- the step reads only persistent device buffers (token ids, the tree as parent indices, the cache
  length and the node count), written before it runs, so nothing per-step is a Python number frozen
  into it: a bucket's step is the same kernels with the same shapes at every position and for every
  tree;
- attention spans the whole cache under a mask built on the device (the prefix below the length, and
  each node's ancestors), the lm_head runs over every row in one matmul, and greedy acceptance runs
  on the device (engines/cuda/accept.py), so a speculative step reads the host once: the accepted
  count, the bonus token, the path and its tokens, in one small tensor;
- the prompt runs eagerly (once per sequence); on CUDA each bucket's step is captured as a CUDA
  graph after warm-up, with an eager fallback (engines/cuda/graphs.py), and SDPA is pinned to the
  flash, memory-efficient and math kernels (cuDNN's builds a plan per new shape; see
  docs/inference.md).

The same code runs on CPU tensors (the tests prove it there: the same logits as the model's own
forward, and greedy speculative tokens equal to plain greedy ones).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import weakref
from typing import Any, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference.config import SamplingConfig
from headway.inference.engines.cuda.accept import greedy_accept, sample_accept, tree_ancestors
from headway.inference.engines.cuda.graphs import StepGraphs
from headway.inference.engines.cuda.tree_attention import BLOCK_N, tree_attention
from headway.inference.engines.distribution import target_distribution
from headway.inference.engines.kv import KVCache
from headway.inference.engines.layer_step import (
    moe_block,
)
from headway.inference.engines.options import EXACT_BUCKETS
from headway.inference.engines.step_model import StepModel
from headway.inference.engines.tree import Tree
from headway.target.families import engine_support

log = logging.getLogger("headway")

# the row buckets of a runner made without inference.cuda_buckets: the one exact bucket
# (engines/options.py)
DEFAULT_BUCKETS = EXACT_BUCKETS
# SDPA's kernels for the backend's attention, in order of preference: never cuDNN's, whose plan is
# built anew for each shape (and the prompt's shapes change with every request)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def pinned_sdpa() -> Any:
    """The context every step of this backend runs in: SDPA without cuDNN."""
    return sdpa_kernel(SDPA_BACKENDS)


def rope_by_position(model: Any) -> bool:
    """Whether the model's rotary tables are a function of the position alone (not rescaled with the
    sequence length, as the dynamic types are, and longrope, whose factors switch from short to long
    past the original context), so the backend can precompute them for every slot."""
    kind = str(getattr(model.model.rotary_emb, "rope_type", "default"))
    return "dynamic" not in kind and "longrope" not in kind


def has_moe(model: Any) -> bool:
    """Whether a decoder layer of the model holds a sparse MoE block (engine_step.moe_block): the
    CUDA backend does not run those (their row-by-row routing reads the host mid-step, which a graph
    cannot)."""
    return any(
        moe_block(getattr(layer, "mlp", None)) for layer in getattr(model.model, "layers", ())
    )


def cuda_supported(model: Any) -> bool:
    """Whether the CUDA backend runs this target: the family table says so (target/families.py:
    family, windows, rope type, soft-capping), its layers hold no MoE block, and the model has the
    parts the backend calls."""
    base = getattr(model, "model", None)
    if (
        base is None
        or not hasattr(base, "layers")
        or not hasattr(base, "rotary_emb")
        or has_moe(model)
    ):
        return False
    return not engine_support(model.config)["cuda"] and rope_by_position(model)


class StepBuffers:
    """The persistent inputs of every step, sized for the largest bucket: token ids [Mmax], parent
    indices [Mmax] (-1: root and pads), and two 0-d counts: the cache length before the step and the
    real node count (each set by a fill with the host's number, so no staging copy can race the step
    that reads it)."""

    def __init__(self, rows: int, device: torch.device):
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.parent = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.n = torch.zeros((), dtype=torch.long, device=device)
        # sampling: one uniform per row, then one for the bonus token (drawn before the step)
        self.uniforms = torch.zeros(rows + 1, dtype=torch.float64, device=device)


class CudaRunner:
    """The bucketed, graph-shaped runner (see the module docstring). A `Runner` (forward, keep,
    truncate) for every decoding loop, plus `step` / `read` / `keep_path`: the greedy loop's
    device-side verification (engines/cuda/loop.py).

    Args:
        model: a target the backend runs (`cuda_supported`: the family table's), rotary tables by
            position alone; max_len: the most tokens a sequence holds; buckets: row counts a step
            pads to (a tree of n nodes runs in the smallest bucket >= n); graphs: capture each
            bucket's step as a CUDA graph (CUDA only; None: on CUDA)."""

    accepts_on_device = True  # (Runner protocol: engines/runner.py): the device loop runs it

    def __init__(
        self,
        model: Any,
        max_len: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        graphs: Optional[bool] = None,
        attention: str = "tree",
    ):
        family = getattr(text_config(model.config), "model_type", "?")
        if getattr(model, "model", None) is not None and has_moe(model):
            raise HeadwayError(
                f"inference.engine=cuda does not run MoE layers (this '{family}' target's): use "
                "inference.engine=static on a CPU, or hf"
            )
        if not cuda_supported(model):
            why = (
                engine_support(model.config)["cuda"] or "its rotary tables rescale with the length"
            )
            raise HeadwayError(
                f"inference.engine=cuda cannot run this '{family}' target ({why}): use inference.engine=auto "
                "or hf"
            )
        # slot `max_len` is the scratch slot pad rows write; no real row reaches it
        self.capacity = max_len + 1
        self.scratch = max_len
        self.max_len = max_len
        self.net = StepModel(model, self.capacity)
        self.device, self.dtype = self.net.device, self.net.dtype
        # tree: every row along its own virtual sequence (kernel_tree_attention; row-exact); masked:
        # SDPA over the whole cache under the tree mask
        self.attention = attention
        # on CPU tensors (never a graph) the torch tree attention skips what cannot change a real
        # row, by host
        # numbers: blocks past the longest row's last key (they leave every row unchanged) and the
        # pad rows (whose outputs only ever reach the scratch slot, which no real row reads). A
        # row's bits do not depend on the others', so the real rows' are the full pass's; the
        # emulation is spared a pass over the whole cache for every pad. A graphable step (CUDA,
        # fake or compiled) runs them all.
        self.trim_blocks = self.device.type == "cpu"
        # the step being run: its longest row's virtual length, its real rows (host)
        self._reach = (0, 0)
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise HeadwayError(
                f"inference.cuda_buckets must be row counts >= 1 (got {list(buckets)})"
            )
        net = self.net
        self.cache = KVCache(
            len(net.layers), net.kv_heads, self.capacity, net.head_dim, self.dtype, self.device
        )
        # (cuDNN's SDPA is kept off by pinned_sdpa() around each step, the prompt and the device
        # loop, never process-wide: the rest of the process, an HF baseline included, keeps torch's
        # own choice)
        self.buf = StepBuffers(self.buckets[-1], self.device)
        self.graphs = StepGraphs(self._step, self.device, enabled=graphs)
        self.sampling: Optional[SamplingConfig] = None  # None: greedy acceptance in the step
        self.length = 0

    def close(self) -> None:
        """Free the runner's graphs and KV cache now (a larger runner replaces it): they are the
        largest things it holds, and a graph left to a later collection could be destroyed inside
        another capture."""
        self.graphs.reset()
        self.cache = None
        self.buf = None

    @classmethod
    def of(
        cls,
        model: Any,
        max_len: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        graphs: Optional[bool] = None,
    ) -> "CudaRunner":
        """The model's runner, emptied, for sequences of up to `max_len` tokens: the one it keeps
        (its buffers, cache and captured graphs reused) while it is long enough and of these
        buckets, else a new one of at least twice the length (so a few long requests do not each
        capture anew). One sequence at a time. The model is the key of a weak table (`_RUNNERS`),
        never given an attribute: the runner goes with the model."""
        kept = _RUNNERS.get(model)
        wanted = tuple(sorted(set(int(b) for b in buckets)))
        p = next(model.parameters())
        if (
            kept is None
            or kept.max_len < max_len
            or kept.buckets != wanted
            or kept.dtype != p.dtype
            or kept.device != p.device
            or kept.graphs.requested != graphs
        ):
            size = max_len if kept is None else max(max_len, 2 * kept.max_len)
            if kept is not None:  # free the old graphs and cache before the new cache is allocated
                _RUNNERS.pop(model, None)
                kept.close()
                del kept
            kept = cls(model, size, buckets, graphs)
            _RUNNERS[model] = kept
        kept.length = 0
        return kept

    # -- the step ------------------------------------------------------------------------------------------

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least n rows."""
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise HeadwayError(
                f"a step of {n} rows exceeds the largest row bucket ({self.buckets[-1]}): add a bucket to "
                "inference.cuda_buckets or draft smaller trees"
            )
        return self.buckets[i]

    def _step(self, m: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Bucket m's step over the persistent buffers: the logits [m, V] of every row, the hidden
        states (transformers' output_hidden_states order, each [m, H], the last normed), and the
        greedy verdict (`accept_device.greedy_accept` [2 + m], then the path's tokens [m]). Reads no
        host value: its every shape is m's or the cache's."""
        ids, parent = self.buf.ids[:m], self.buf.parent[:m]
        start, n = self.buf.start, self.buf.n
        r = torch.arange(m, device=self.device)
        ancestors = tree_ancestors(parent)
        depth = ancestors.sum(1) - 1
        positions = start + depth
        slots = torch.where(r < n, start + r, torch.full_like(r, self.scratch))
        cols = torch.arange(self.capacity, device=self.device)
        rel = cols - start
        in_tree = (rel >= 0) & (rel < m)
        tree_part = ancestors.gather(1, rel.clamp(0, m - 1).expand(m, -1)) & in_tree
        masks = {"full_attention": (cols < start)[None, :] | tree_part}
        # a key is seen while its position is less than the window behind
        if self.net.window is not None:
            col_pos = torch.where(in_tree, start + depth.gather(0, rel.clamp(0, m - 1)), cols)
            masks["sliding_attention"] = masks["full_attention"] & (
                positions[:, None] - col_pos[None, :] < self.net.window
            )
        attends = {kind: None for kind in masks}
        if self.attention == "tree":
            # each row's virtual sequence: the prefix, then its ancestors' slots by depth (itself
            # last)
            where = torch.where(
                ancestors, depth[None, :], torch.full_like(ancestors, m, dtype=torch.long)
            )
            tails = torch.zeros(m, m + 1, dtype=torch.long, device=self.device)
            # (pads: the scratch slot)
            own = torch.where(r < n, start + r, torch.full_like(r, self.scratch))
            tails = tails.scatter_(1, where, own[None, :].expand(m, m))[:, :m]
            trim = None
            if self.trim_blocks and not torch.compiler.is_compiling():
                trim = (-(-self._reach[0] // BLOCK_N), self._reach[1])
            for kind in masks:
                window = self.net.window if kind == "sliding_attention" else None
                attends[kind] = _TreeAttend(start, tails, depth + 1, window, trim, n)
        rope = {
            kind: (cos.index_select(0, positions), sin.index_select(0, positions))
            for kind, (cos, sin) in self.net.rope.items()
        }
        x = self.net.embed(ids)
        states = [x]
        for i, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
            kind = self.net.kinds[i]
            x = self.net.layer(
                i, x, *rope[kind], k, v, slots, self.capacity, masks[kind], attend=attends[kind]
            )
            states.append(x)
        x = self.net.norm(x)
        states[-1] = x
        logits = self.net.logits(x)
        if self.sampling is None:
            verdict = greedy_accept(ids, parent, ancestors, logits.argmax(-1), n)
        else:
            probs = target_distribution(logits, self.sampling)
            uniforms = torch.cat((self.buf.uniforms[:m], self.buf.uniforms[-1:]))
            verdict = sample_accept(ids, parent, ancestors, probs, uniforms, n)
        return logits, states, torch.cat((verdict, ids.gather(0, verdict[2:])))

    def step(
        self, ids: torch.Tensor, parent: torch.Tensor, n: int
    ) -> tuple[Any, list, torch.Tensor]:
        """Verify n nodes continuing the cache: ids [n] and parent [n] (device or host tensors) go
        into the persistent buffers, and bucket(n)'s step runs (its graph where captured). Returns
        its outputs (see `_step`), views of the graph's own memory where captured: read them before
        the next step."""
        if self.length + n > self.max_len:
            raise HeadwayError(
                f"internal: static cache of {self.max_len} positions overflows ({self.length} + {n})"
            )
        m = self.bucket(n)
        self.buf.ids[:n].copy_(ids.view(-1), non_blocking=True)
        self.buf.parent[:n].copy_(parent.view(-1), non_blocking=True)
        if m > n:
            self.buf.parent[n:m].fill_(-1)
        self.buf.start.fill_(self.length)
        self.buf.n.fill_(n)
        self._reach = (self.length + n, n)
        with pinned_sdpa():
            out = self.graphs.run(m)
        self.length += n
        return out

    def set_sampling(self, cfg: SamplingConfig) -> None:
        """The acceptance the step runs: greedy (temperature 0), else tree rejection sampling under
        `cfg`; a change drops the captured graphs (they hold the other rule)."""
        # (the seed is the loop's)
        wanted = None if cfg.greedy else dataclasses.replace(cfg, seed=0)
        if wanted != self.sampling:
            self.sampling = wanted
            # (freed now, not by a collection that might run inside the next capture)
            self.graphs.reset()

    @staticmethod
    def read(verdict: torch.Tensor) -> list[int]:
        """The speculative step's one device-to-host read: the verdict as a list."""
        return verdict.tolist()

    def keep_path(self, tree_size: int, path: torch.Tensor) -> None:
        """Keep the accepted path (device node indices [k], root first) of the last `tree_size`
        entries, by one gather-copy over every layer; no host read."""
        first = self.length - tree_size
        self.cache.compact(first, (path + first).clamp(max=self.scratch))
        self.length = first + path.shape[0]

    # -- the Runner interface --------------------------------------------------------------------------------

    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[torch.Tensor, Any]:
        ids = ids.view(-1)
        n = ids.shape[0]
        if self.length == 0 and tree is None and n > 1:
            return self._prefill(ids.to(self.device), hidden)
        parent = list(range(-1, n - 1)) if tree is None else tree.parent
        logits, states, _ = self.step(ids, torch.tensor(parent, dtype=torch.long), n)
        states_n = tuple(h[None, :n] for h in states) if hidden else None
        return logits[:n], states_n

    def _prefill(self, ids: torch.Tensor, hidden: bool) -> tuple[Any, Any]:
        """The prompt at the cache's start, eagerly: causal attention over its own slots; logits of
        the last row only (the one the loops read)."""
        n = ids.shape[0]
        if n > self.max_len:
            raise HeadwayError(
                f"internal: a prompt of {n} tokens overflows the {self.max_len}-slot cache"
            )
        slots = torch.arange(n, device=self.device)
        x = self.net.embed(ids)
        sliding = None  # the sliding layers' mask, where the prompt is longer than the window
        if self.net.window is not None and n > self.net.window:
            sliding = (slots[:, None] >= slots[None, :]) & (
                slots[:, None] - slots[None, :] < self.net.window
            )
        states = (
            [x] if hidden else []
        )  # (kept only when asked: [n, hidden] per layer is a long prompt's bulk)
        with pinned_sdpa():
            for i, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                cos, sin = self.net.rope[self.net.kinds[i]]
                mask = sliding if self.net.kinds[i] == "sliding_attention" else None
                x = self.net.layer(
                    i, x, cos[:n], sin[:n], k, v, slots, n, mask, causal=mask is None
                )
                if hidden:
                    states.append(x)
        x = self.net.norm(x)
        if hidden:
            states[-1] = x
        self.length = n
        logits = _LastRowLogits(self.net.logits(x[-1:]), n)
        return logits, tuple(h[None] for h in states) if hidden else None

    def keep(self, tree_size: int, keep: list[int]) -> None:
        self.keep_path(tree_size, torch.tensor(keep, dtype=torch.long, device=self.device))

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


# each model's kept runner (CudaRunner.of); a runner holds the model's parts, not the model, so the
# entry goes when the model does
_RUNNERS: "weakref.WeakKeyDictionary[Any, CudaRunner]" = weakref.WeakKeyDictionary()


class _TreeAttend:
    """A step's row-exact attention (kernel_tree_attention) as `layer_step` calls it: q [n, heads,
    head_dim] over the layer's cache, each row along its own virtual sequence. `trim` (blocks, real
    rows): the CPU emulation's host bounds (CudaRunner.trim_blocks); `rows`: the step's real row
    count (a device tensor), past which the kernel's rows read nothing."""

    def __init__(
        self,
        start: torch.Tensor,
        tails: torch.Tensor,
        lens: torch.Tensor,
        window: Optional[int],
        trim: Optional[tuple[int, int]] = None,
        rows: Optional[torch.Tensor] = None,
    ):
        self.start, self.tails, self.lens, self.window, self.trim = start, tails, lens, window, trim
        self.rows = rows

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self.trim is None:
            return tree_attention(
                q, k, v, self.start, self.tails, self.lens, scale, self.window, rows=self.rows
            )
        # the CPU emulation (CudaRunner.trim_blocks): the real rows over the blocks they reach; pads
        # get zeros
        blocks, n = self.trim
        real = tree_attention(
            q[:n],
            k,
            v,
            self.start,
            self.tails[:n],
            self.lens[:n],
            scale,
            self.window,
            blocks=blocks,
        )
        return torch.cat((real, real.new_zeros(q.shape[0] - n, real.shape[1])))


class _LastRowLogits:
    """The prompt's logits as the loops read them: only the last row exists (index -1 or n - 1)."""

    def __init__(self, last: torch.Tensor, n: int):
        self.last, self.n = last, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if int(i) % self.n != self.n - 1:
            raise HeadwayError("internal: the CUDA backend keeps only the prompt's last logits row")
        return self.last[0]
