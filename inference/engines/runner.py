"""Target runners: the decoding loops' one interface to the target's forward pass and KV cache.

`HFRunner` calls the model's own forward with a transformers cache: any architecture transformers
runs. `StaticRunner` keeps the keys and values in preallocated tensors and runs its own attention
around the model's own modules (embedding, norms, projections, MLP, rotary embedding), so it follows
the model's family without a forked modeling file. It has no per-step reallocation, compacts an
accepted tree path in place, and skips transformers' mask and cache machinery. Llama-style families
with full attention are supported (llama with any rope type computed by position: default, linear,
llama3, yarn; qwen2; mistral without a sliding window; qwen3 with its per-head q/k norms; smollm3
with its NoPE layers; the MoE families qwen3_moe and mixtral, routed row by row; target/families.py
says which engines run each family); others use `HFRunner`. Both give the same logits (tests compare
them in float64). The compiled engine is the static one with its decoder stack under torch.compile
(`ModelEngine.compiled_stack`; not for MoE layers); the cuda engine (`CudaRunner`) is the static
engine's CUDA backend: bucketed steps over persistent buffers, CUDA graphs, greedy acceptance on the
device (not for MoE layers either).

The modules behind it, one job each: engines/layer_step.py (the layer math every static backend
shares), engines/kv.py (the KV cache), engines/static/plans.py (the CPU backend's attention plans),
engines/static/runner.py (the CPU backend, and `StaticLayerCache`, the EAGLE drafter's layer),
engines/cuda/runner.py and engines/cuda/graphs.py (the CUDA backend and its graphs),
engines/cuda/accept.py (tree bookkeeping and greedy acceptance on the device).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import torch

from headway.errors import HeadwayError
from headway.inference.engines.cuda.runner import CudaRunner, cuda_supported
from headway.inference.engines.hf import HFRunner
from headway.inference.engines.options import EngineOptions, as_options
from headway.inference.engines.static.runner import StaticRunner, _row_exact_dtype
from headway.inference.engines.tree import Tree
from headway.target.families import engine_support, family_of


class Runner(Protocol):
    """What the decoding loops need of an engine's runner (hf.py, static/runner.py,
    cuda/runner.py)."""

    # verifies and accepts a tree on the device in fixed row buckets (the CUDA backend): the device
    # loop (cuda/loop.py) runs it, and one step's cost is one value per bucket
    accepts_on_device: bool

    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[Any, Any]:
        """Logits [n, V] (a tensor, or LazyLogits: rows by index) of `ids` (a chain continuing the
        cache, or the nodes of `tree` rooted after it) and, with `hidden`, the hidden states indexed
        as transformers' output_hidden_states (batch row 0 first)."""

    def keep(self, tree_size: int, keep: list[int]) -> None:
        """Of the last `tree_size` cache entries keep those at indices `keep` (the accepted
        path)."""

    def truncate(self, length: int) -> None:
        """Forget every cache entry past the first `length`."""


def static_supported(model: Any) -> bool:
    """Whether the static engine runs this target: the family table says so (target/families.py:
    family, attention windows, rope type), and the model has the parts the engine calls."""
    base = getattr(model, "model", None)
    return (
        not engine_support(model.config)["static"]
        and base is not None
        and hasattr(base, "layers")
        and hasattr(base, "rotary_emb")
    )


def engine_name(model: Any, engine: Union[str, EngineOptions] = "auto") -> str:
    """The engine `engine` (a name, or EngineOptions) means for this model: auto is the CUDA backend
    (cuda) for a target it runs on a CUDA device, else static where supported, else hf
    (target/families.py says which engines run a family).

    Raises:
        HeadwayError: the engine asked for cannot run this target (one line with the table's
            reason)."""
    engine = as_options(engine).engine
    name = family_of(model.config).name
    if engine == "cuda" and not cuda_supported(model):
        why = (
            engine_support(model.config)["cuda"] or "the model lacks the modules the backend calls"
        )
        raise HeadwayError(
            f"inference.engine=cuda cannot run this {name} target: {why}; use inference.engine=auto or hf"
        )
    if engine in ("static", "compiled") and not static_supported(model):
        why = (
            engine_support(model.config)["static"] or "the model lacks the modules the engine calls"
        )
        raise HeadwayError(
            f"inference.engine={engine} cannot run this {name} target: {why}; use inference.engine=auto or hf"
        )
    if engine == "auto":
        if next(model.parameters()).device.type == "cuda" and cuda_supported(model):
            return "cuda"
        return "static" if static_supported(model) else "hf"
    return engine


def depth_matters(model: Any, engine: Union[str, EngineOptions] = "auto") -> bool:
    """Whether a verification's cost depends on its tree's depth, not only its size: the row-exact
    engines (static and compiled, bf16/fp16 on CPUs) run one attention call per depth level
    (RowAttention)."""
    p = next(model.parameters())
    return engine_name(model, engine) in ("static", "compiled") and _row_exact_dtype(
        p.dtype, p.device
    )


def make_runner(
    model: Any, max_len: int, engine: Union[str, EngineOptions] = "auto", rows: int = 1
) -> Any:
    """A fresh runner (empty cache) for sequences of up to `max_len` tokens.

    Args:
        model: the target; engine: a name (auto, see `engine_name`; static, compiled, cuda
            (engines/cuda/runner.py; it runs on CPU tensors too), hf) with the default settings, or
            the EngineOptions to run with (the static engine's layer loop and kernels, the CUDA
            backend's buckets and graphs: never read from the model); rows: the most rows a step
            will verify (a tree's nodes and the root), which the CUDA backend's largest bucket must
            hold.
    Returns:
        A `Runner`: forward(ids [n], tree=None, hidden=False) -> (logits [n, V], hidden states),
        keep(), truncate(). Static runners of one model share its KV buffers (`ModelEngine`), and
        the cuda engine's its runner (`CudaRunner.of`): one sequence at a time.
    Raises:
        HeadwayError: a step of `rows` rows exceeds the CUDA backend's largest bucket."""
    opts = as_options(engine)
    name = engine_name(model, opts)
    if name == "hf":
        return HFRunner(model)
    if name == "cuda":
        buckets = opts.buckets()
        if rows > buckets[-1]:
            raise HeadwayError(
                f"a draft tree of {rows} rows exceeds the CUDA backend's largest row bucket ({buckets[-1]}): "
                f"pass cuda_buckets=({-(-rows // 16) * 16},) to plain and speculative decoding alike, or "
                "draft smaller trees"
            )
        return CudaRunner.of(model, max_len, buckets, opts.cuda_graphs)
    return StaticRunner(
        model,
        max_len,
        compiled=name == "compiled",
        loop=opts.layer_loop,
        row_attention=opts.row_attention,
        fused_ops=opts.fused_ops,
        prompt_attention=opts.prompt_attention,
    )
