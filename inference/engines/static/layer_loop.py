"""The static engine's decoder layers as one C++ call (csrc/layer_loop.cpp), built on first use.

A decoding step of a small target makes about a thousand small ATen calls (norms, rotary, cache
writes, attention, residuals, projections), and on a CPU the Python between them costs about as much
as the kernels (docs/benchmarks.md). The C++ loop makes the same calls in the same order with the
same arguments, so every output bit is the Python loop's (tests compare them); only the interpreter
leaves the step. bf16 steps run there with fused element-wise kernels instead (csrc/fused_ops.cpp,
`target.fused_ops`). It needs a C++ compiler the first time (torch's extension builder, cached under
TORCH_EXTENSIONS_DIR); without one, or for a layer it does not cover, the engine keeps its Python
loop.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

import torch
from torch import nn
from transformers import activations

from headway.errors import HeadwayError
from headway.runtime import resolve_device
from headway.target import stream_kernel
from headway.target.build import load_extension
from headway.target.config import LAYER_LOOPS, ROW_ATTENTIONS, TargetConfig
from headway.target.cpu_format import may_stream
from headway.target.packed_fbgemm import FBGEMM_CHUNKED_ROWS, fbgemm_rows_vary
from headway.target.packed_float16 import Float16Linear
from headway.target.packed_mkl import MKL_PACKED_ROWS, MKLLinear
from headway.target.packed_onednn import OneDNNLinear
from headway.target.packed_stream import STREAM_MAX_ROWS, StreamLinear

log = logging.getLogger("headway")

SOURCES = [
    os.path.join(os.path.dirname(__file__), "csrc", name)
    for name in (
        "layer_loop.cpp",
        "row_attention.cpp",
        "fused_ops.cpp",
        "prompt_attention.cpp",
        "row_select.cpp",
    )
]
# -ffp-contract=off: no fused multiply-adds but where a kernel's build asks for them (the row
# attention's FMA builds), so that vector and scalar paths of the same arithmetic round alike
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# the C++ loop's linear kinds (csrc/layer_loop.cpp `Kind`)
_NATIVE, _ONEDNN, _MKL, _STREAM, _FP16 = 0, 1, 2, 3, 4
# the activations that are F.silu (transformers 5 has its own module for it)
_SILU = tuple(c for c in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if c is not None)
_BUILT: list[Any] = []  # [module] once built, [None] once a build failed
# held while building: a caller waits for a build started in the background
_LOCK = threading.Lock()


def extension() -> Optional[Any]:
    """The compiled extension module, built once per process (and cached on disk by torch); None
    where it cannot be built here, with one warning that says why."""
    if _BUILT:  # (every decoding step asks, for its row plan: no lock once built)
        return _BUILT[0]
    with _LOCK:
        return _extension_locked()


def _extension_locked() -> Optional[Any]:
    if not _BUILT:
        try:
            built = load_extension(
                "headway_layer_loop",
                SOURCES,
                CFLAGS,
                announce="building the static engine's C++ layer loop and row attention (once; cached by "
                "torch's extension builder)",
                verbose=False,
            )
            _BUILT.append(built)
        except Exception as e:  # no compiler, no headers: decoding still works, in the Python loop
            log.warning(
                "the C++ layer loop did not build (%s); the static engine runs its Python loop and "
                "torch's attention (set target.layer_loop=python target.row_attention=sdpa to skip the "
                "attempt)",
                str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__,
            )
            _BUILT.append(None)
    return _BUILT[0]


def build_in_background(cfg: TargetConfig) -> None:
    """Start building the C++ kernels that decoding with `cfg` will use (the layer loop, and the
    streaming linear where the format may be it), each on its own thread, so that a first run
    compiles them while the target is fetched, dequantised and loaded instead of after; the first
    use of each waits for its build. Once cached, a build only loads the library. Nothing starts for
    a target decoded off the CPU.

    Args:
        cfg: the target section as the user left it (dtype and linear_weights may still be auto).
    """
    if resolve_device(cfg.device).type != "cpu":
        return
    if may_stream(cfg):
        stream_kernel.build_in_background()
    if not _BUILT and (cfg.layer_loop != "python" or cfg.row_attention != "sdpa"):
        threading.Thread(target=extension, name="headway-build-layer-loop").start()


def built() -> Optional[Any]:
    """The extension module if this process has built it already (the static engine builds it as it
    loads), else None; never starts a build."""
    return _BUILT[0] if _BUILT else None


def _linear_spec(module: nn.Module) -> Optional[tuple]:
    """A linear as the C++ loop takes it: (kind, weight, packed, bias, rows, fbgemm's packed float16
    weight or the bf16 streaming kernel's packed tensor or None, float16's scale), or None for a
    format it lacks."""
    if isinstance(module, OneDNNLinear):
        return (_ONEDNN, torch.empty(0), module.packed, module.bias, module.pad, None, 1.0)
    if isinstance(module, MKLLinear):
        return (
            _MKL,
            module.weight.detach(),
            module.packed,
            module.bias,
            MKL_PACKED_ROWS,
            None,
            1.0,
        )
    if isinstance(module, StreamLinear):
        if (
            module.packed is not None
        ):  # bf16: the prompts' oneDNN copy, the output count, the kernel's packed copy
            weight = module._weight()
            prompt = module.prompt[0] if module.prompt else torch.empty(0)
            weight = torch.empty(0) if weight is None else weight
            return (_STREAM, weight, prompt, module.bias, module.out_features, module.packed, 1.0)
        # float32: prompts through oneDNN over the weight as loaded (`packed` then holds it too),
        # else torch's linear
        weight = module.weight.detach()
        prompt = weight if module.prompt is not None else torch.empty(0)
        return (_STREAM, weight, prompt, module.bias, STREAM_MAX_ROWS, None, 1.0)
    # bf16 calls of up to `rows` rows go in row-exact chunks (0: never)
    if isinstance(module, Float16Linear):
        chunked = FBGEMM_CHUNKED_ROWS if fbgemm_rows_vary() else 0
        # bf16 prompts' oneDNN copy (BF16_PROMPT_ROWS)
        prompt, bias = module.prompt or (torch.empty(0), None)
        return (_FP16, torch.empty(0), prompt, bias, chunked, module.packed, module.scale)
    if type(module) is nn.Linear:
        bias = None if module.bias is None else module.bias.detach()
        return (_NATIVE, module.weight.detach(), torch.empty(0), bias, 1, None, 1.0)
    return None


def _modules(plan: Any) -> list:
    qkv, o, mlp, down = plan.linears
    return [*qkv, o, *mlp, down]


def unsupported(plans: list, final_norm: Any) -> Optional[str]:
    """Why the C++ loop cannot run these LayerPlans (a format, a norm or an activation it lacks), or
    None."""
    for plan in plans:
        if plan.moe is not None:  # (its row-by-row routing: engine_step.MoeRows, in Python)
            return "MoE layers"
        norms = (plan.norm1, plan.norm2) + (
            (plan.q_norm, plan.k_norm) if plan.q_norm is not None else ()
        )
        if any(getattr(norm, "eps", None) is None for norm in norms):
            return "a norm other than the lean RMSNorm"
        if not isinstance(plan.mlp.act_fn, _SILU):
            return f"the activation {type(plan.mlp.act_fn).__name__}"
        for module in _modules(plan):
            if _linear_spec(module) is None:
                return f"{type(module).__name__} weights"
    if (
        getattr(final_norm, "weight", None) is None
        or getattr(final_norm, "variance_epsilon", None) is None
    ):
        return "a final norm other than RMSNorm"
    return None


def _head_spec(plan: Any) -> tuple:
    """A layer's additions to the Llama layer as the C++ loop takes them (csrc/layer_loop.cpp
    `HeadSpec`): its q and k norms' weights and eps (Qwen3; None elsewhere) and whether it rotates
    (SmolLM3's NoPE layers do not)."""
    if plan.q_norm is None:
        return (None, None, 0.0, 0.0, plan.rope)
    q, k = plan.q_norm, plan.k_norm
    return (q.weight.detach(), k.weight.detach(), float(q.eps), float(k.eps), plan.rope)


def loop_mode(mode: str) -> str:
    """A `target.layer_loop` setting as the engine takes it (auto where it names none of
    LAYER_LOOPS)."""
    return mode if mode in LAYER_LOOPS else "auto"


def build_loop(plans: list, final_norm: Any, mode: str = "auto") -> Optional[Any]:
    """The C++ loop over `plans` (engine_step.LayerPlan, lean) and the model's final norm; None when
    `mode` is python, or (auto) when it cannot build or cover these layers. mode=cpp makes either of
    those an error."""
    if mode == "python":
        return None
    reason = unsupported(plans, final_norm)
    ext = None if reason else extension()
    if ext is None:
        if mode == "cpp":
            raise HeadwayError(
                "target.layer_loop=cpp: the C++ layer loop cannot run this target "
                f"({reason or 'it did not build'}); use target.layer_loop=auto or python"
            )
        if reason:
            log.info(
                "the static engine runs its Python loop: the C++ loop does not cover %s", reason
            )
        return None
    p = plans[0]
    return ext.LayerLoop(
        [plan.norm1.weight for plan in plans],
        [plan.norm2.weight for plan in plans],
        [float(plan.norm1.eps) for plan in plans],
        [float(plan.norm2.eps) for plan in plans],
        [
            (
                [_linear_spec(m) for m in plan.linears[0]],
                _linear_spec(plan.linears[1]),
                [_linear_spec(m) for m in plan.linears[2]],
                _linear_spec(plan.linears[3]),
            )
            for plan in plans
        ],
        final_norm.weight.detach(),
        float(final_norm.variance_epsilon),
        p.heads,
        p.kv_heads,
        p.head_dim,
        p.inter,
        p.scaling,
        [_head_spec(plan) for plan in plans],
    )


def row_attention_mode(mode: str) -> str:
    """A `target.row_attention` setting as the engine takes it (auto unless one of
    ROW_ATTENTIONS)."""
    return mode if mode in ROW_ATTENTIONS else "auto"


def row_kernel(mode: str = "auto") -> Optional[Any]:
    """The C++ row-exact attention (csrc/row_attention.cpp) for `target.row_attention` = mode: None
    for sdpa, or (auto) where the extension does not build; cpp makes that an error."""
    if mode == "sdpa":
        return None
    ext = extension()
    if ext is None and mode == "cpp":
        raise HeadwayError(
            "target.row_attention=cpp: the C++ row attention did "
            "not build here; use target.row_attention=auto or sdpa"
        )
    return None if ext is None else ext.row_attention


def row_plan(attend: Any) -> Any:
    """engine.RowAttention's plan for the C++ loop."""
    return extension().RowPlan(
        attend.kernel is not None,
        attend.start,
        attend.kt_valid,
        attend.tails,
        attend.lens,
        attend.order,
        attend.in_order,
        attend.slots,
        attend.groups,
    )
