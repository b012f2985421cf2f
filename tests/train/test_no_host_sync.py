"""A training step reads nothing back to the host, and keeps every tensor on the training device.

Two checks of the same step code (train/step.py, `TrainStep.run_planned`: forward, backward and the
update of grad_accum micro-batches), for every head kind:
- on a fake CUDA device (tests/helpers/fake_cuda.py), where `.item()` and `nonzero()` raise and a
  CPU tensor mixed into a CUDA op raises `FakeTensorDeviceMismatchError`; a dispatch mode counts the
  host reads and uploads that remain. The CPU build's autograd engine cannot run a backward on CUDA
  tensors (it asks for a CUDA accelerator), so here the backward is replaced by zero gradients and
  the optimizer step (fused AdamW, as on CUDA) runs on them;
- on the CPU with real tensors, backward included, where function and dispatch modes see every
  `item`, `tolist`, `bool()`, `nonzero` and boolean-mask index.
The host's part of a step (reading the stream, collating, the objectives' index plans) runs before,
in `TrainStep.plan`, on host tensors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.fake_cuda import fake_cuda, to_fake_cuda
from tests.helpers.tiny_models import ARCHS, make_tiny_model
from tests.helpers.train_helpers import small_run

KINDS = {
    "medusa": [],
    "eagle": ["head.eagle.feature_noise=0"],
    "eagle3": ["head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=3"],
    "dflash": ["head.dflash.draft_vocab_size=64"],
}
HOST_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "unique", "_unique2"}
HOST_CALLS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "cpu"}


class DeviceTraffic(TorchDispatchMode):
    """Counts the ops that read tensor values on the host, boolean-mask indexing, and host<->device
    copies.

    `skip`: ids of tensors whose reads are not the step's (torch's non-fused Adam keeps its step
    counters on the host by design: reading them waits on nothing)."""

    def __init__(self, skip: frozenset = frozenset()):
        super().__init__()
        self.reads, self.uploads, self.skip = Counter(), 0, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = args[0] if args else None
        if name in HOST_OPS and id(first) not in self.skip:
            self.reads[name] += 1
        if name == "index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
            self.reads["boolean-mask index"] += 1
        if name == "_to_copy" and isinstance(first, torch.Tensor):
            to = torch.device(kwargs.get("device") or first.device)
            if first.device.type == "cpu" and to.type == "cuda" and first.numel():
                # (transformers' DynamicCache starts from an empty upload: no bytes)
                self.uploads += 1
            if first.device.type == "cuda" and to.type == "cpu":
                self.reads["device-to-host copy"] += 1
        return func(*args, **kwargs)


class HostCalls(TorchFunctionMode):
    """Counts Python-level reads of tensor values (CPU `tolist` never reaches ATen)."""

    def __init__(self, skip: frozenset = frozenset()):
        super().__init__()
        self.calls, self.skip = Counter(), skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_CALLS and not (args and id(args[0]) in self.skip):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def parts(model_dir: Path, data: Path, out: Path, kind: str, *extra: str):
    """The named recipe steps up to one training step (train/loop.py), lagged finite check."""
    from headway.train import loop

    cfg = small_run(
        model_dir, data, out, f"head.kind={kind}", "train.finite_check=lagged", *KINDS[kind], *extra
    )
    run = loop.setup_run(cfg)
    target = loop.setup_target(run)
    data_ = loop.setup_data(run, target)
    model = loop.setup_model(run, target, data_)
    return cfg, run, target, data_, model, loop.setup_step(run, target, data_, model)


SETTINGS = {
    "padded": [],
    "packed, recompute, chunked": [
        "train.packing=true",
        "train.max_length=128",
        "train.ttt_attention=recompute",
        "train.loss_chunk=16",
    ],
}


@pytest.mark.parametrize("settings", sorted(SETTINGS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_cpu_training_step_reads_nothing_back(
    tiny_dirs, tiny_data, tmp_path: Path, kind: str, settings: str
):
    *_, model, step = parts(
        tiny_dirs["llama"], tiny_data, tmp_path / "r", kind, *SETTINGS[settings]
    )
    step(1, 0)  # the optimizer's state exists from here on
    counters = frozenset(id(s["step"]) for s in model.optimizer.state.values() if "step" in s)
    plan = step.plan(2, step.plan(1, 0).end)
    traffic, calls = DeviceTraffic(counters), HostCalls(counters)
    with calls, traffic:
        outcome = step.run_planned(plan)
    assert dict(traffic.reads) == {} and dict(calls.calls) == {}
    # and the step did train: its figures are there, still tensors
    assert outcome.loss.dim() == 0 and torch.isfinite(outcome.loss) and outcome.grad_norm > 0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_fake_cuda_training_step_has_no_host_read_and_no_cpu_tensor(
    tiny_dirs, tiny_data, tmp_path: Path, kind: str, monkeypatch
):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from headway.train.distributed import HeadObjective, Parallel, TorchStep
    from headway.train.objectives import OBJECTIVES
    from headway.train.optim import cosine_schedule, make_optimizer
    from headway.train.step import FiniteCheck, TrainStep

    cfg, run, target, data, model, _ = parts(
        tiny_dirs["llama"], tiny_data, tmp_path / "r", kind, "train.autocast_dtype=bfloat16"
    )
    tc = cfg.train
    # flex attention runs as one kernel, outside the counting mode (torch refuses to run it under a
    # user dispatch mode); its block masks are built inside it
    from torch.utils._python_dispatch import _pop_mode_temporarily

    from headway.train import ttt_flex

    def uncounted(compile: bool):
        flex = ttt_flex.flex_attention

        def run(*args, **kwargs):
            with _pop_mode_temporarily():
                return flex(*args, **kwargs)

        return run

    monkeypatch.setattr(ttt_flex, "_compiled", uncounted)
    with fake_cuda():
        cuda = torch.device("cuda", 0)
        to_fake_cuda(target.model, model.heads)
        par = Parallel(device=cuda)
        # the kind's objective as a CUDA run resolves it (EAGLE-3: flex attention, a chunked loss)
        from headway.train.loop import argmax_from_data, loss_chunk, ttt_attention

        planner = OBJECTIVES[kind](
            model.heads.cfg,
            seed=tc.seed,
            loss_chunk=loss_chunk(tc.loss_chunk, cuda),
            ttt_attention=ttt_attention(tc.ttt_attention, cuda),
        )
        objective = HeadObjective(model.heads, planner)
        params = [p for p in objective.parameters() if p.requires_grad]
        optimizer = make_optimizer([{"params": params, "lr": tc.lr}], tc, cuda)
        assert optimizer.defaults["fused"]
        stepper = TorchStep(
            optimizer,
            cosine_schedule(optimizer, 2, 6, 0.1),
            params,
            [],
            tc.grad_clip,
            tc.grad_accum,
            par,
        )
        t2d = model.context.t2d
        context = replace(
            model.context,
            objective=objective,
            plan=planner,
            device=cuda,
            argmax_from_data=argmax_from_data(tc.target_argmax, cuda, data.greedy),
            t2d=None if t2d is None else t2d.to(cuda),
        )
        step = TrainStep(
            context, stepper, data.train_set, tc, par, FiniteCheck("lagged", run.out, par)
        )
        losses = []

        def backward(loss: torch.Tensor) -> None:
            losses.append(loss)
            for p in params:
                p.grad = torch.zeros_like(p)

        stepper.backward = backward
        with unset_fake_temporarily():
            plan = step.plan(1, 0)
        traffic = DeviceTraffic()
        # flex attention traces its backward graph on the query's device as it runs, which a
        # CPU-only torch cannot do for CUDA tensors: EAGLE-1's and EAGLE-3's flex path runs its
        # forward here without autograd
        flex = kind in ("eagle", "eagle3")  # the kinds with a draft attention layer
        with traffic, torch.set_grad_enabled(not flex):
            outcome = step.run_planned(plan)
    assert dict(traffic.reads) == {}
    # the only uploads are the planned micro-batches themselves
    assert traffic.uploads == sum(len(planned) for planned, _, _ in plan.micro)
    assert len(losses) == tc.grad_accum and all(x.device == cuda and x.dim() == 0 for x in losses)
    assert planner.ttt_attention == "flex" and planner.loss_chunk == 4096
    assert outcome.loss.device == outcome.grad_norm.device == cuda
    assert all(v.device == cuda for v in outcome.metrics.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_training_forward_keeps_the_models_own_values(tmp_path: Path, arch: str):
    """The mask-free causal forward with hooked layers gives transformers' own hidden states and
    logits, bit for bit (Gemma-3 also wider than its sliding window, where its own attention applies
    the window)."""
    from transformers import AutoModelForCausalLM

    from headway.train.target_features import target_features

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(arch, tmp_path / arch)).eval()
    widths = [40, 150] if arch == "gemma3" else [40]
    for width in widths:
        ids = torch.randint(0, 300, (2, width), generator=torch.Generator().manual_seed(width))
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            layers = list(range(len(out.hidden_states)))
            hidden, logits = target_features(model, ids, layers)
        assert torch.equal(logits, out.logits)
        assert all(torch.equal(hidden[i], out.hidden_states[i]) for i in layers)


def test_collectives_get_device_tensors_and_a_cpu_tensor_is_named(monkeypatch):
    """On a (fake) CUDA run of 2 ranks, the loss and metric averages reach all_reduce as CUDA
    tensors and stay there; HEADWAY_CHECK_COLLECTIVES refuses the CPU tensor Parallel.mean used to
    all-reduce."""
    import torch.distributed as dist

    from headway.errors import HeadwayError
    from headway.train import distributed

    seen = []
    # in-place no-ops standing in for NCCL; restored after the test
    for name in distributed._COLLECTIVES:
        monkeypatch.setattr(dist, name, lambda t, *a, **k: seen.append(t.device))
    monkeypatch.setattr(distributed, "CHECKED", {})
    with fake_cuda():
        cuda = torch.device("cuda", 0)
        distributed.check_collectives(cuda)
        par = distributed.Parallel("ddp", 0, 2, cuda)
        means = par.mean(
            {"loss": torch.ones((), device=cuda), "top1": torch.zeros((), device=cuda), "n": 3}
        )
        assert all(v.device == cuda for v in means.values())
        with pytest.raises(
            HeadwayError, match=r"torch.distributed.all_reduce was given a tensor on cpu, but the "
        ):
            dist.all_reduce(torch.ones(2, dtype=torch.float64))
    assert seen == [cuda] and distributed.CHECKED == {"all_reduce": 2}
