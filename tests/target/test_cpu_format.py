"""The fastest exact CPU format (target.dtype=auto, target/cpu_format.py): which format each kind of
CPU gets, that every decoding command takes it by default and decodes exactly in it, that a dtype
set is decoded as set, and that everything else loads `auto` as float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from headway.config import load_config
from headway.demo import decoding_target
from headway.demo_config import DemoConfig
from headway.run_config import RunConfig
from headway.target import cpu_format
from headway.target.config import TargetConfig
from headway.target.cpu_format import fastest_cpu_format
from tests.helpers.decode_helpers import fast_format
from tests.kinds.test_eagle import random_head


def chosen(cfg: TargetConfig) -> tuple[str, str]:
    t, _ = fastest_cpu_format(cfg)
    return t.dtype, t.linear_weights


@pytest.mark.parametrize("amx,stream", [(True, True), (False, True), (False, False)])
def test_a_cpu_with_bf16_kernels_takes_onednn_on_amx_and_the_bf16_stream_elsewhere(
    monkeypatch, amx: bool, stream: bool
):
    """oneDNN's bf16 kernels: on AMX its trees are nearly free; without AMX (AVX512-BF16) Headway's
    bf16 streaming linear makes the faster step and cheaper trees, or where it cannot build,
    fbgemm's float16 one-row kernel (docs/bench-kernels.md)."""

    def missing(fmt: str, dtype=torch.bfloat16):
        return "not built" if (fmt, dtype) == ("stream", torch.bfloat16) and not stream else None

    monkeypatch.setattr(cpu_format, "kernels_missing", missing)
    monkeypatch.setattr(cpu_format, "amx_bf16", lambda: amx)
    want = "onednn" if amx else "stream" if stream else "float16"
    assert chosen(TargetConfig(device="cpu", num_threads=2)) == ("bfloat16", want)


@pytest.mark.parametrize("stream", ["bf16", "float32", "none"])
def test_a_cpu_without_bf16_kernels_decodes_in_its_fastest_format(monkeypatch, stream: str):
    """An AVX2 CPU (no oneDNN bf16 kernels): bf16 through the streaming linear's AVX2 build, or
    float32 through it where its bf16 rows cannot run, or where it cannot build at all, float32 with
    oneDNN-packed weights (MKL-packed on one thread)."""

    def missing(fmt: str, dtype=torch.bfloat16):
        if (fmt, dtype) == ("onednn", torch.bfloat16):
            return "not on this CPU"
        if fmt == "stream" and (
            stream == "none" or (stream == "float32" and dtype == torch.bfloat16)
        ):
            return "not built"
        return None

    monkeypatch.setattr(cpu_format, "kernels_missing", missing)
    for threads, fallback in ((2, "onednn"), (1, "mkl")):
        want = {
            "bf16": ("bfloat16", "stream"),
            "float32": ("float32", "stream"),
            "none": ("float32", fallback),
        }
        assert chosen(TargetConfig(device="cpu", num_threads=threads)) == want[stream]


@pytest.mark.parametrize("amx", [True, False])
def test_the_stream_kernel_is_built_early_wherever_the_policy_may_pick_it(monkeypatch, amx: bool):
    """may_stream (which starts the kernel's build before the target loads) answers yes wherever
    fastest_cpu_format can end at the streaming linear, and no where it cannot."""
    monkeypatch.setattr(cpu_format, "amx_bf16", lambda: amx)
    monkeypatch.setattr(cpu_format, "kernels_missing", lambda fmt, dtype=torch.bfloat16: None)
    for cfg, without_amx, with_amx in (
        (TargetConfig(device="cpu"), True, False),
        (TargetConfig(device="cpu", dtype="float32"), False, False),
        (TargetConfig(device="cpu", linear_weights="stream"), True, True),
        (TargetConfig(device="cpu", linear_weights="onednn"), False, False),
        (TargetConfig(device="meta"), False, False),
    ):
        assert chosen(cfg)[1] != "stream" or cpu_format.may_stream(cfg), cfg
        assert cpu_format.may_stream(cfg) == (with_amx if amx else without_amx), cfg


def test_the_fast_format_applies_only_where_the_target_is_left_at_its_defaults():
    for cfg in (
        TargetConfig(device="cpu", dtype="float32"),
        TargetConfig(device="cpu", dtype="float64"),
        TargetConfig(device="cpu", linear_weights="float16"),
    ):
        # asked for something else: decoded as asked
        assert fastest_cpu_format(cfg) == (cfg.as_loaded(), "")
    assert TargetConfig(device="cpu", linear_weights="float16").as_loaded().dtype == "float32"
    t, why = fastest_cpu_format(TargetConfig(device="cpu"))
    assert "target.dtype=float32" in why  # the line says how to decode in float32


def test_the_demo_takes_the_same_format():
    t = decoding_target(DemoConfig())
    assert (t.dtype, t.linear_weights) == fast_format()
    t = decoding_target(DemoConfig(target=TargetConfig(dtype="float32")))
    assert (t.dtype, t.linear_weights) == ("float32", "native")


def test_training_and_distillation_load_auto_as_float32(tiny_dirs):
    from headway.target.loading import load_target
    from headway.target.packed_model import linear_weights

    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1))
    assert t.model.dtype == torch.float32 and linear_weights(t.model) == "native"


def test_decoding_commands_take_the_fast_format_and_stay_exact(tiny_dirs, tmp_path: Path):
    """SpeculativeDecoder.load (generate, bench, tune, demo) decodes a target left at its defaults
    in the fast format, where speculative decoding still equals plain greedy decoding;
    target.dtype=float32 keeps float32."""
    from headway.inference.api import SpeculativeDecoder
    from headway.kinds.checkpoint import save_head
    from headway.target.loading import load_target
    from headway.target.packed_model import linear_weights

    base = TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1)
    t = load_target(base)
    head = save_head(random_head(t, "eagle3"), tmp_path / "head", t.fingerprint)
    overrides = ["inference.max_new_tokens=16", "inference.use_tuned=false"]
    for dtype, want in (("auto", fast_format()), ("float32", ("float32", "native"))):
        cfg = load_config(RunConfig, None, overrides)
        cfg.target = dataclasses.replace(base, dtype=dtype)
        decoder = SpeculativeDecoder.load(head, cfg)
        model = decoder.target.model
        assert (str(model.dtype).removeprefix("torch."), linear_weights(model)) == want
        r = decoder.chat("Tell me about the sea.")
        assert r.plain is not None and r.spec.tokens == r.plain.tokens
