"""The decoding engine's settings, passed from the config to the runner as one typed value.

Nothing here is written onto the HF model or the head: the engine (auto, static, compiled, cuda,
hf), the CUDA backend's row buckets and graphs, and the static engine's layer loop, row attention,
fused kernels and prompt attention travel as an `EngineOptions` from `EngineOptions.of(target
config, inference config)` (or a caller's own) through `speculative_generate` / `plain_generate` /
`make_runner` to the runner. A caller that passes none gets the defaults, and on the CUDA backend
the exact single bucket (`EXACT_BUCKETS`): plain and tree steps then run the same GEMM shapes, so
greedy speculative decoding gives plain greedy decoding's tokens in every dtype (docs/inference.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from headway.errors import HeadwayError
from headway.inference.config import cuda_buckets

# the one row bucket of a CUDA runner whose caller names none: GPU-sized trees (EAGLE-2's 60 nodes
# and the root, the hybrid's 60) fit it, and a plain step runs in it too, so every step keeps a
# row's bits
EXACT_BUCKETS: tuple[int, ...] = (64,)


@dataclass(frozen=True)
class EngineOptions:
    """How the target's forward runs (hashable: cost curves are cached per value).

    Attributes:
        engine: auto, static, compiled, cuda or hf (engine.engine_name).
        cuda_buckets: the CUDA backend's row buckets; () = one exact bucket (`EXACT_BUCKETS`).
        cuda_graphs: capture each bucket's step as a CUDA graph (None: on CUDA).
        layer_loop, row_attention, fused_ops, prompt_attention: the static engine's target.*
            settings.
    """

    engine: str = "auto"
    cuda_buckets: tuple[int, ...] = ()
    cuda_graphs: Optional[bool] = None
    layer_loop: str = "auto"
    row_attention: str = "auto"
    fused_ops: bool = True
    prompt_attention: str = "auto"

    def __post_init__(self) -> None:
        buckets = tuple(int(b) for b in self.cuda_buckets)
        if any(b < 1 for b in buckets):
            raise HeadwayError(
                f"inference.cuda_buckets must be row counts >= 1 (got {list(buckets)})"
            )
        object.__setattr__(self, "cuda_buckets", tuple(sorted(set(buckets))))

    @classmethod
    def of(cls, target: Any = None, inference: Any = None) -> "EngineOptions":
        """The options a run config gives: the target.* engine settings of `target` (a TargetConfig)
        and the inference.* ones of `inference` (an InferenceConfig, whose empty cuda_buckets means
        the one bucket its drafters' largest tree fits: config.cuda_buckets); either None keeps the
        defaults."""
        kw: dict[str, Any] = {}
        if target is not None:
            kw.update(
                layer_loop=target.layer_loop,
                row_attention=target.row_attention,
                fused_ops=bool(target.fused_ops),
                prompt_attention=target.prompt_attention,
            )
        if inference is not None:
            kw.update(
                engine=inference.engine,
                cuda_buckets=cuda_buckets(inference),
                cuda_graphs=inference.cuda_graphs,
            )
        return cls(**kw)

    def buckets(self) -> tuple[int, ...]:
        """The CUDA backend's row buckets: the ones asked for, else the exact single bucket."""
        return self.cuda_buckets or EXACT_BUCKETS

    def with_engine(self, engine: str) -> "EngineOptions":
        return replace(self, engine=engine)


def as_options(engine: Union[str, EngineOptions, None]) -> EngineOptions:
    """`engine` as options: a name (auto, static, ...) with the defaults, or the options
    themselves."""
    if engine is None:
        return EngineOptions()
    if isinstance(engine, EngineOptions):
        return engine
    if isinstance(engine, str):
        return EngineOptions(engine=engine)
    raise HeadwayError(
        f"internal: engine must be a name or EngineOptions, not {type(engine).__name__}"
    )
