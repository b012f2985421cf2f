"""Checks that a step can be captured as a CUDA graph, on a CPU: a torch.compile backend that
refuses what `fullgraph=True` lets through, and an op trace for frozen Python scalars.

torch 2.13's `fullgraph=True` compiles `.item()`, `int(t)`, `nonzero()` and boolean-mask indexing
into unbacked symbols; on CUDA each is a host sync, illegal in a captured graph. `checking_backend`
fails on them, and lists the graph inputs mutated in place, which must be the KV cache alone.
`op_trace` records a step's (op, shapes, non-tensor arguments): two steps of one bucket must record
the same trace, or a per-step Python number is frozen into what a graph would replay.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._python_dispatch import TorchDispatchMode

FORBIDDEN = {
    "item",
    "tolist",
    "nonzero",
    "_local_scalar_dense",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
}
VIEWS = {
    "view",
    "reshape",
    "transpose",
    "select",
    "narrow",
    "unsqueeze",
    "squeeze",
    "expand",
    "permute",
}


class CaptureRefused(AssertionError):
    """A compiled step holds something a CUDA graph cannot."""


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if hasattr(node, "meta") else None


def _root_placeholder(node: Any) -> Any:
    """The graph input a tensor node views (through view ops and indexing), or None."""
    while node.op != "placeholder":
        if node.op in ("call_method", "call_function") and (
            _name(node.target) in VIEWS or node.target is operator.getitem
        ):
            node = node.args[0]
        else:
            return None
    return node


class CheckingBackend:
    """A torch.compile backend: checks each graph, then runs it as FX code. `graphs` counts the
    graphs compiled; `mutated` names the graph inputs written in place (their dynamo source
    names)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.mutated: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = _name(node.target)
            if name in FORBIDDEN:
                raise CaptureRefused(
                    f"{name} in a captured step (a host sync on CUDA): {node.format_node()}"
                )
            if node.target is operator.getitem and len(node.args) > 1:
                index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
                for i in index:
                    v = _value(i)
                    if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
                        raise CaptureRefused(
                            f"boolean-mask indexing in a captured step: {node.format_node()}"
                        )
            v = _value(node)
            if v is not None and free_unbacked_symbols(v):
                raise CaptureRefused(
                    f"a data-dependent size in a captured step: {node.format_node()}"
                )
            if name.endswith("_") and not name.startswith("_") and node.args:
                root = _root_placeholder(node.args[0])
                if root is None:
                    continue  # a temporary of the step's own
                arg = root.meta.get("grapharg")
                name = getattr(arg.source, "name", root.name) if arg is not None else root.name
                self.mutated.add(name() if callable(name) else name)
        return gm.forward


class OpTrace(TorchDispatchMode):
    """Records every op as (name, argument shapes and dtypes, non-tensor arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}

        def sig(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return ("T", tuple(a.shape), str(a.dtype), str(a.device))
            if isinstance(a, (list, tuple)):
                return tuple(sig(x) for x in a)
            return repr(a)

        self.ops.append(
            (str(func), sig(args), tuple(sorted((k, sig(v)) for k, v in kwargs.items())))
        )
        return func(*args, **kwargs)
