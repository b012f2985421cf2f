"""The static engine's C++ layer loop: the Python loop's bits for every step kind, format and family
it covers, and the Python loop (with one clear message where asked for) where it does not apply or
does not build."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from headway.errors import HeadwayError
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.runner import make_runner
from headway.inference.engines.static import layer_loop
from headway.inference.engines.static.runner import StaticRunner
from headway.runtime import native_bf16
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from headway.target.packed_capability import kernels_missing
from headway.target.packed_onednn import BF16_PROMPT_ROWS
from tests.helpers.decode_helpers import engine_steps, load_packed

FORMATS = [
    ("float64", "native"),
    ("float32", "native"),
    ("float32", "onednn"),
    ("float32", "mkl"),
    ("float32", "stream"),
    ("float32", "float16"),
    ("bfloat16", "native"),
    ("bfloat16", "onednn"),
    ("bfloat16", "float16"),
    ("bfloat16", "stream"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "dtype,fmt,attention",
    [(d, f, "auto") for d, f in FORMATS]
    + [("bfloat16", f, "sdpa") for d, f in FORMATS if d == "bfloat16"],
)
@torch.inference_mode()
def test_cpp_loop_gives_the_python_loops_bits(
    tiny_dirs, arch: str, dtype: str, fmt: str, attention: str
):
    """With either row attention (bf16's row-exact steps): the C++ kernel, or torch's per row.
    (bf16's fused element-wise kernels are the other path,
    tests/inference/engines/static/test_fused_ops.py; off here.)"""
    if fmt != "native" and kernels_missing(fmt, getattr(torch, dtype)):
        pytest.skip(kernels_missing(fmt, getattr(torch, dtype)))
    t = load_packed(tiny_dirs[arch], fmt, dtype)
    python = StaticRunner(t.model, 64, loop="python", row_attention=attention)
    # (prompts through torch's attention, as the Python loop's: Headway's prompt kernel
    # is tests/inference/engines/static/test_fused_ops.py's)
    cpp = StaticRunner(
        t.model, 64, loop="cpp", row_attention=attention, fused_ops=False, prompt_attention="sdpa"
    )
    assert not python.fused_ops and not cpp.fused_ops
    assert python._loop is None and cpp._loop is not None
    assert (
        (python.row_kernel is not None)
        == (cpp.row_kernel is not None)
        == (python.row_exact and attention == "auto")
    )
    a = engine_steps(python)
    b = engine_steps(cpp)
    assert len(a) == len(b)
    # bit for bit: the loop makes the same kernel calls in the same order
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@torch.inference_mode()
@pytest.mark.parametrize("fmt", ["float16", "stream"])
def test_cpp_loop_gives_the_python_loops_bits_after_a_long_bf16_prompt(tiny_dirs, fmt: str):
    """A prompt of BF16_PROMPT_ROWS rows or more takes the oneDNN copy of each float16 or bf16
    stream linear in both loops (bf16 stream without oneDNN's bf16 kernels: float32 over the
    weight), and the decoding steps after it fbgemm's or the streaming kernel. (The fused loop:
    test_packed_linear's long-prompt decoding test.)"""
    if fmt == "float16" and kernels_missing("onednn", torch.bfloat16):
        pytest.skip("no oneDNN bf16 kernels here")
    if kernels_missing(fmt, torch.bfloat16):
        pytest.skip(kernels_missing(fmt, torch.bfloat16))
    t = load_packed(
        tiny_dirs["qwen2"], fmt, "bfloat16"
    )  # qwen2: q/k/v biases, which the copy keeps
    python = StaticRunner(t.model, 256, loop="python")
    cpp = StaticRunner(t.model, 256, loop="cpp", fused_ops=False, prompt_attention="sdpa")
    for ids in (torch.arange(10, 10 + BF16_PROMPT_ROWS + 3), torch.tensor([7]), torch.tensor([8])):
        (la, ha), (lb, hb) = python.forward(ids, hidden=True), cpp.forward(ids, hidden=True)
        assert torch.equal(la[len(la) - 1], lb[len(lb) - 1])
        assert all(torch.equal(x, y) for x, y in zip(ha, hb))


class ScaledLinear(torch.nn.Linear):
    """A linear of a kind the loop does not know (a user's own module in a target's layer)."""


@torch.inference_mode()
def test_a_format_the_loop_lacks_keeps_the_python_loop(tiny_dirs, caplog):
    t = load_packed(tiny_dirs["llama"], "native", "float32")
    attn = t.model.model.layers[0].self_attn
    o = ScaledLinear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False)
    o.weight = attn.o_proj.weight
    attn.o_proj = o
    with caplog.at_level(logging.INFO, logger="headway"):
        assert StaticRunner(t.model, 32)._loop is None
    assert "does not cover ScaledLinear weights" in caplog.text
    with pytest.raises(
        HeadwayError,
        match=r"target.layer_loop=cpp: .*ScaledLinear weights.*layer_loop=auto or python",
    ):
        StaticRunner(t.model, 32, loop="cpp")


def test_a_build_started_in_the_background_is_the_one_the_first_use_gets(monkeypatch):
    """build_in_background compiles on a thread (a first run's kernels build while the target
    loads); the first use waits for that build rather than starting another, and nothing starts
    where the loop is not used."""
    import threading

    calls = []
    release = threading.Event()

    def slow_build(name, sources, cflags, **kwargs):
        calls.append(threading.current_thread().name)
        release.wait(30)
        return f"module {name}"

    monkeypatch.setattr(layer_loop, "_BUILT", [])
    monkeypatch.setattr(layer_loop, "load_extension", slow_build)
    layer_loop.build_in_background(
        TargetConfig(device="cpu", layer_loop="python", row_attention="sdpa")
    )
    assert calls == [] and layer_loop.built() is None
    layer_loop.build_in_background(TargetConfig(device="cpu", linear_weights="native"))
    builder = next(t for t in threading.enumerate() if t.name == "headway-build-layer-loop")
    got = []
    user = threading.Thread(target=lambda: got.append(layer_loop.extension()))
    user.start()
    user.join(0.5)
    assert user.is_alive() and calls == [
        "headway-build-layer-loop"
    ]  # waiting for the background build
    release.set()
    user.join(30)
    builder.join(30)
    assert got == ["module headway_layer_loop"] and calls == ["headway-build-layer-loop"]
    assert layer_loop.built() == "module headway_layer_loop"


@torch.inference_mode()
def test_a_loop_that_does_not_build_falls_back_with_one_warning(tiny_dirs, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'headway_layer_loop'\ng++: command not found")

    monkeypatch.setattr(layer_loop, "_BUILT", [])
    monkeypatch.setattr(layer_loop, "load_extension", no_compiler)
    t = load_packed(tiny_dirs["qwen2"], "native", "float32")
    with caplog.at_level(logging.WARNING, logger="headway"):
        assert StaticRunner(t.model, 32, loop="auto")._loop is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "the C++ layer loop did not build (g++: command not found); the static engine runs its Python loop "
        "and torch's attention (set target.layer_loop=python target.row_attention=sdpa to skip the attempt)"
    ]
    with pytest.raises(HeadwayError, match="it did not build"):
        StaticRunner(t.model, 32, loop="cpp")
    # a bf16 target's row-exact steps take torch's attention instead, or say why they cannot where
    # cpp was asked for
    t16 = load_packed(tiny_dirs["qwen2"], "native", "bfloat16")
    assert StaticRunner(t16.model, 32).row_kernel is None
    with pytest.raises(
        HeadwayError, match=r"target.row_attention=cpp: .*did not build.*row_attention=auto or sdpa"
    ):
        StaticRunner(t16.model, 32, row_attention="cpp")


def test_the_target_settings_reach_the_engine(tiny_dirs):
    """target.* engine settings travel from the loaded target's settings to the runner as
    EngineOptions; the model holds none of them."""

    def runner(t):
        assert not [a for a in vars(t.model) if a.startswith(("headway", "_headway"))]
        return make_runner(t.model, 32, EngineOptions.of(t.settings))

    cfg = TargetConfig(
        name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, layer_loop="python"
    )
    assert runner(load_target(cfg))._loop is None
    with pytest.raises(HeadwayError, match="target.layer_loop"):
        TargetConfig(layer_loop="c++")
    bf16 = load_target(
        dataclasses.replace(cfg, layer_loop="auto", dtype="bfloat16", row_attention="sdpa")
    )
    assert runner(bf16).row_kernel is None
    if (
        layer_loop.extension() is not None
    ):  # bf16 and float32 steps take the fused kernels unless told not to
        assert runner(bf16).fused_ops
        off = load_target(
            dataclasses.replace(cfg, layer_loop="auto", dtype="bfloat16", fused_ops=False)
        )
        assert not runner(off).fused_ops
        f32 = load_target(dataclasses.replace(cfg, layer_loop="auto"))
        assert runner(f32).fused_ops
        assert not runner(
            load_target(dataclasses.replace(cfg, layer_loop="auto", dtype="float64"))
        ).fused_ops
        # float32 prompts: Headway's kernel on AVX-512 CPUs
        assert runner(f32).prompt_kernel == layer_loop.extension().prompt_attention_f32_available()
        # a fresh bf16 prompt's attention (native bf16 CPUs): Headway's kernel on bf16 brgemm (AMX),
        # or on float32 brgemm over the bf16 values (AVX-512), unless told not to
        ext = layer_loop.extension()
        available = native_bf16(torch.device("cpu")) and (
            ext.prompt_attention_available() or ext.prompt_attention_f32_available()
        )
        assert runner(bf16).prompt_kernel == available
        sdpa = load_target(
            dataclasses.replace(cfg, layer_loop="auto", dtype="bfloat16", prompt_attention="sdpa")
        )
        assert not runner(sdpa).prompt_kernel
        assert not runner(off).prompt_kernel
    with pytest.raises(HeadwayError, match="target.row_attention"):
        TargetConfig(row_attention="flash")
    with pytest.raises(HeadwayError, match="target.prompt_attention"):
        TargetConfig(prompt_attention="flash")
