"""Medusa-2 on a large target (GPU training review, finding 17): the adapted target's decoder layers
under activation checkpointing, the distillation loss a chunk of rows at a time, and the LoRA
gradients averaged across ranks in one all-reduce. Each keeps the values and gradients it had.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from headway.config import load_config
from headway.errors import HeadwayError
from headway.run_config import RunConfig
from headway.train import loop, step
from headway.train.distributed import Parallel
from headway.train.losses import distill_kl, wide
from headway.train.step import (
    TrainStep,
    plan_batch,
    plan_packed,
    step_loss,
    target_checkpointing,
)
from tests.kinds.test_train_medusa import MEDUSA2, train_cfg


def medusa2(tiny_dirs, tiny_data, out: Path, *extra: str):
    """A Medusa-2 run's model on the tiny Llama (float32, CPU), its LoRA adapters made non-zero
    (fresh ones have B = 0, so that A's gradient would be 0 whatever the backward did)."""
    cfg = train_cfg(tiny_dirs["llama"], tiny_data, out, *MEDUSA2, *extra)
    run = loop.setup_run(cfg)
    target = loop.setup_target(run)
    data = loop.setup_data(run, target)
    model = loop.setup_model(run, target, data)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in target.model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.05)
    return model, target, data


def micro_batch(model, target, data, packed: bool) -> tuple[dict, list]:
    samples = data.train_set[:4]
    pad = target.tokenizer.pad_token_id or 0
    if not packed:
        return plan_batch(samples, pad, model.context.plan), samples
    rows = [samples[:2], samples[2:]]
    length = max(sum(len(s.input_ids) for s in row) for row in rows)
    return plan_packed(rows, length, pad, model.context.plan), samples


def tensors_in(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors_in(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in tensors_in(item)]
    return []


def one_step(model, target, planned, samples, checkpointed: bool, monkeypatch) -> tuple:
    """(saved bytes, loss, gradients) of one Medusa-2 micro-batch (adapters on).

    Saved bytes: the storages autograd keeps for backward (parameters excluded), counted with
    saved_tensors_hooks, and those a checkpointed layer keeps as its inputs (its recomputation's
    arguments, which no hook sees), each storage once."""
    kept: dict[int, tuple[torch.Tensor, int]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            kept[storage.data_ptr()] = (t, storage.nbytes())
        return t

    real = step.checkpoint
    calls = []

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        for t in tensors_in(list(args)) + tensors_in(kwargs):
            keep(t)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(step, "checkpoint", counting)
    params = dict(target.model.named_parameters())
    params.update({f"head.{n}": p for n, p in model.heads.named_parameters()})
    for p in params.values():
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, _ = step_loss(model.context, planned, samples, True, checkpointed)
    saved = sum(size for _, size in kept.values())
    kept.clear()
    loss.backward()
    monkeypatch.setattr(step, "checkpoint", real)
    n_layers = len(step.decoder_layers(target.model))
    assert len(calls) == (n_layers if checkpointed else 0)
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    return saved, loss.detach(), grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_checkpointed_target_keeps_less_and_gives_the_same_gradients(
    tiny_dirs, tiny_data, tmp_path: Path, monkeypatch, packed: bool
):
    model, target, data = medusa2(tiny_dirs, tiny_data, tmp_path / "run")
    planned, samples = micro_batch(model, target, data, packed)
    plain_bytes, plain_loss, plain = one_step(model, target, planned, samples, False, monkeypatch)
    ckpt_bytes, ckpt_loss, ckpt = one_step(model, target, planned, samples, True, monkeypatch)
    lora = [n for n in plain if "lora_" in n]
    heads = [n for n in plain if n.startswith("head.")]
    assert len(lora) == 4 * 4 * 2 and heads  # A and B of q, k, v, o in each of 4 layers
    assert plain.keys() == ckpt.keys()
    assert any(plain[n].abs().sum() > 0 for n in lora if "lora_A" in n)
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=0, atol=0)
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-6, atol=1e-9, msg=n)
    # each layer keeps its input only: most of the target's activations are gone
    print(f"saved for backward: {plain_bytes} B unchecked, {ckpt_bytes} B checkpointed")
    assert ckpt_bytes < 0.6 * plain_bytes


def test_the_frozen_forward_and_evaluation_are_not_checkpointed(
    tiny_dirs, tiny_data, tmp_path: Path, monkeypatch
):
    """Heads-only steps (no gradient through the target) run its layers as they are."""
    model, target, data = medusa2(tiny_dirs, tiny_data, tmp_path / "run")
    planned, samples = micro_batch(model, target, data, False)
    called = []
    monkeypatch.setattr(step, "checkpoint", lambda *a, **k: called.append(1))
    step_loss(model.context, planned, samples, adapt=False, checkpoint_target=True)
    assert not called
    layers = step.decoder_layers(target.model)
    assert all("forward" not in layer.__dict__ for layer in layers)  # the patch is undone


def reference_kl(adapted, frozen, mask):
    """distill_kl as it was: the float32 log-softmax of both whole [B, T, V] tensors (float64 kept
    float64 here, as the chunked loss keeps it)."""
    logp = F.log_softmax(wide(adapted), -1)
    logq = F.log_softmax(wide(frozen), -1)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


class LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            if t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def kl_inputs(dtype: torch.dtype, B: int = 2, T: int = 64, V: int = 400):
    torch.manual_seed(0)
    adapted = (torch.randn(B, T, V, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    frozen = (adapted.detach().double() + torch.randn(B, T, V, dtype=torch.float64)).to(dtype)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T // 2 :] = 0  # right padding
    return adapted, frozen, mask


def largest_float32(fn, adapted, frozen, mask) -> int:
    with LargestFloat32() as mode:
        (fn(adapted, frozen, mask) * 0.5).backward()
    return mode.largest


def test_distill_kl_makes_no_float32_tensor_over_a_chunk():
    adapted, frozen, mask = kl_inputs(torch.bfloat16)
    B, T, V = adapted.shape
    chunk = 16
    before = largest_float32(reference_kl, adapted, frozen, mask)
    adapted.grad = None
    after = largest_float32(lambda a, f, m: distill_kl(a, f, m, chunk=chunk), adapted, frozen, mask)
    print(
        f"largest float32 tensor: {before} elements before, {after} after (chunk x V = {chunk * V})"
    )
    assert before == B * T * V
    assert after <= chunk * V


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 16, 48, 0])
def test_distill_kl_in_chunks_is_the_whole_loss(dtype: torch.dtype, chunk: int):
    """The same value and gradient as the whole-tensor loss, for chunks that divide the 128 rows,
    that do not, one row and one pass; under a loss scale, as the step's distill weight and
    accumulation give it."""
    adapted, frozen, mask = kl_inputs(dtype)
    (reference_kl(adapted, frozen, mask) * 0.3).backward()
    want_grad, adapted.grad = adapted.grad, None
    want = reference_kl(adapted, frozen, mask)
    got = distill_kl(adapted, frozen, mask, chunk=chunk)
    (got * 0.3).backward()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 1e-3)
    atol = {torch.float64: 1e-15, torch.float32: 1e-9, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(adapted.grad, want_grad, rtol=tol, atol=atol)
    assert adapted.grad[1, 32:].abs().max() == 0  # no gradient at the padding
    with torch.no_grad():  # evaluation: no gradient kept
        torch.testing.assert_close(distill_kl(adapted, frozen, mask, chunk=chunk), got.detach())


def lora_like_params() -> list[torch.nn.Parameter]:
    """LoRA-shaped parameters with gradients: A [r, in] and B [out, r] of a few projections, one
    without a gradient (skipped), one non-contiguous gradient."""
    torch.manual_seed(0)
    params = []
    for _ in range(4):
        for shape in ((4, 16), (16, 4)):
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.randn(shape)
            params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient
    odd = torch.nn.Parameter(torch.zeros(8, 5))
    odd.grad = torch.randn(5, 8).t()
    params.append(odd)
    return params


def test_lora_gradients_are_averaged_in_one_all_reduce(monkeypatch):
    """Two ranks simulated: the collective adds a second rank's gradients (3x this rank's, so the
    mean is 2x); one call per step, and the averages each parameter's own all-reduce gave."""
    params = lora_like_params()
    want = [None if p.grad is None else (p.grad + 3 * p.grad) / 2 for p in params]
    calls = []

    def fake_all_reduce(t, *args, **kwargs):
        calls.append(t.shape)
        t.add_(3 * t)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    Parallel("ddp", 0, 2).all_reduce_grads(params)
    print(f"all-reduce calls per step: {len(calls)} (was one per parameter: {len(params) - 1})")
    assert len(calls) == 1
    for p, w in zip(params, want):
        if w is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


def test_lora_all_reduce_in_a_gloo_group(tmp_path: Path, monkeypatch):
    """A real one-process gloo group: one collective, the gradients unchanged (the mean of one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        params = lora_like_params()
        want = [None if p.grad is None else p.grad.clone() for p in params]
        real, calls = dist.all_reduce, []

        def counting(t, *args, **kwargs):
            calls.append(t.numel())
            return real(t, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", counting)
        Parallel("ddp", 0, 1).all_reduce_grads(params)
        assert calls == [sum(p.numel() for p in params if p.grad is not None)]
        for p, w in zip(params, want):
            assert (p.grad is None) if w is None else torch.equal(p.grad, w)
    finally:
        dist.destroy_process_group()


def test_target_checkpointing_setting():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert target_checkpointing("auto", cuda, model) and not target_checkpointing(
        "auto", cpu, model
    )
    assert target_checkpointing("layers", cpu, model)
    assert not target_checkpointing("none", cuda, model)
    flat = torch.nn.Linear(2, 2)  # no model.layers
    assert not target_checkpointing("auto", cuda, flat)
    with pytest.raises(HeadwayError, match="train.target_checkpointing=layers"):
        target_checkpointing("layers", cpu, flat)
    with pytest.raises(
        HeadwayError, match=r"train.target_checkpointing='full'.*auto, layers, none"
    ):
        load_config(RunConfig, None, ["train.target_checkpointing=full"])
    assert load_config(RunConfig, None, []).train.target_checkpointing == "auto"


@pytest.mark.parametrize(
    "setting, lora_warmup, on",
    [("layers", 0, True), ("none", 0, False), ("auto", 0, False), ("layers", None, False)],
)
def test_the_step_resolves_target_checkpointing(setting: str, lora_warmup, on: bool):
    """A Medusa-2 step (lora_warmup set) checkpoints as train.target_checkpointing says (auto: not
    on a CPU); a step without adapters never does."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    tokenizer = SimpleNamespace(pad_token_id=0)
    target = SimpleNamespace(model=model, tokenizer=tokenizer)
    run = SimpleNamespace(target=target, device=torch.device("cpu"))
    tc = SimpleNamespace(micro_batch_size=1, seed=0, length_window=0, target_checkpointing=setting)
    step_ = TrainStep(run, None, [], tc, Parallel(), None, lora_warmup=lora_warmup)
    assert step_.checkpoint_target is on
