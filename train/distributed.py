"""Several processes training one head, launched by torchrun (or deepspeed): DDP, FSDP2 or DeepSpeed
ZeRO (train/deepspeed_engine.py), gloo on CPU, nccl on GPU.

The head and its objective run as one module (`HeadObjective`), so every parameter is used inside
the forward that DDP and FSDP wrap. Each rank reads a disjoint slice of every global micro-batch;
losses and metrics are averaged across ranks; rank 0 writes logs and exports; checkpoints gather the
full state (every rank takes part) so that a run can resume, also under another world size.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from headway.errors import HeadwayError
from headway.ranks import dist_info

log = logging.getLogger("headway")


class HeadObjective(torch.nn.Module):
    """A head with its kind's training objective (train/objectives/): forward(batch, features, t2d)
    -> (loss, metrics)."""

    def __init__(self, heads: torch.nn.Module, objective: Any):
        super().__init__()
        self.heads = heads
        self._objective = objective

    def forward(self, batch: dict, feats: Any, t2d: Any) -> tuple[torch.Tensor, dict]:
        return self._objective(self.heads, batch, feats, t2d)


@dataclass
class Parallel:
    """This process's place in the run and the collectives the loop needs (no-ops when alone)."""

    backend: str = "none"
    rank: int = 0
    world_size: int = 1
    # The training device: every tensor a collective receives lives here (NCCL takes only CUDA
    # tensors).
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.backend != "none"

    def shard(self, items: list) -> list:
        """This rank's share of a global micro-batch of world_size x micro_batch_size items."""
        n = len(items) // self.world_size
        return items[self.rank * n : (self.rank + 1) * n]

    def mean(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Average each 0-dim tensor across ranks, in one all-reduce on the training device (every
        rank gets the result, on the device; nothing is read back to the host here).

        Args:
            values: name -> 0-dim tensor (or Python number) on any device.
        Returns:
            name -> 0-dim float32 tensor on `self.device`, the mean over ranks.
        """
        if not values:
            return {}
        keys = sorted(values)
        t = torch.stack(
            [torch.as_tensor(values[k], device=self.device).float().reshape(()) for k in keys]
        )
        if self.active:
            dist.all_reduce(t)
            t = t / self.world_size
        return dict(zip(keys, t.unbind()))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over ranks (one all-reduce; the same shape on every rank, as the collective
        needs)."""
        if self.active:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def all_reduce_grads(self, params: list[torch.Tensor]) -> None:
        """Average gradients of parameters outside the wrapped module (Medusa-2's LoRA adapters):
        flattened into one buffer per dtype (one, for adapters of one dtype), so that a step makes
        one all-reduce rather than one per parameter (hundreds, for LoRA on every projection of
        every layer), then copied back. The same sums over ranks divided by the world size."""
        if not self.active:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world_size
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view(g.shape))

    def gather_objects(self, obj: Any) -> list:
        if not self.active:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        """End of the run: wait for every rank, then leave the process group, so launchers exit
        0."""
        if self.active and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if CHECKED:
            log.info(
                "%s: every collective's tensors were on %s (%s)",
                CHECK_COLLECTIVES,
                self.device,
                ", ".join(f"{k} x{v}" for k, v in sorted(CHECKED.items())),
            )


def rank_device(device: torch.device) -> torch.device:
    """This rank's own device: on CUDA the GPU of its local rank (made the current one, so that a
    bare "cuda" and every later allocation land there rather than on cuda:0), else `device`."""
    if device.type != "cuda":
        return device
    info = dist_info()
    if device.index is not None and info.world_size > 1 and device.index != info.local_rank:
        raise HeadwayError(
            f"target.device={device} names one GPU for {info.world_size} processes, and rank "
            f"{info.rank} (local rank {info.local_rank}) would share it: set target.device=cuda or auto"
        )
    if device.index is None:
        device = torch.device("cuda", dist_info().local_rank)
    torch.cuda.set_device(device)
    return device


# HEADWAY_CHECK_COLLECTIVES=1 makes every collective called through torch.distributed refuse a
# tensor that is not on the training device: NCCL rejects CPU tensors, but only on a GPU machine,
# mid-run. The 2-process tests set it; a user may set it to find such a call in their own extension.
CHECK_COLLECTIVES = "HEADWAY_CHECK_COLLECTIVES"
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


CHECKED: dict[str, int] = {}  # collective name -> calls checked in this process


def check_collectives(device: torch.device) -> None:
    """Wrap torch.distributed's tensor collectives so that a tensor off `device` raises, naming the
    call.

    Args:
        device: the training device every collective's tensors must be on.
    """

    def tensors(x: Any) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for item in x for t in tensors(item)]
        return []

    for name in _COLLECTIVES:
        real = getattr(dist, name)
        real = getattr(real, "_headway_real", real)

        def checked(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            CHECKED[_name] = CHECKED.get(_name, 0) + 1
            for t in tensors(list(args) + list(kwargs.values())):
                if t.device != device:
                    raise HeadwayError(
                        f"torch.distributed.{_name} was given a tensor on {t.device}, but the training "
                        f"device is {device}: NCCL refuses it; move it with .to({str(device)!r}) first"
                    )
            return _real(*args, **kwargs)

        checked._headway_real = real
        setattr(dist, name, checked)


def start(backend: str, device: torch.device, timeout_min: float = 30) -> Parallel:
    """Join the launcher's process group (gloo on CPU; nccl bound to this rank's GPU on CUDA) for a
    distributed backend.

    Args:
        backend: train.backend (none, ddp, fsdp, deepspeed).
        device: the configured training device; on CUDA this rank's GPU is taken (`rank_device`).
        timeout_min: how long a collective waits for the other ranks (train.dist_timeout_min).
    Returns:
        The run's `Parallel`: rank, world size and the device collectives run on.
    """
    info = dist_info()
    device = rank_device(device)
    if backend == "none":
        if info.world_size > 1:
            raise HeadwayError(
                f"launched as {info.world_size} processes but train.backend=none: set train.backend=ddp, "
                "fsdp or deepspeed (or launch one process)"
            )
        return Parallel(device=device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_min)
        # device_id binds NCCL (and the object collectives) to this rank's GPU
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    par = Parallel(backend, dist.get_rank(), dist.get_world_size(), device)
    if os.environ.get(CHECK_COLLECTIVES) == "1":
        check_collectives(device)
    log.info(
        "distributed: %s over %s, rank %d of %d",
        backend,
        dist.get_backend(),
        par.rank,
        par.world_size,
    )
    return par


def wrap(
    module: torch.nn.Module,
    par: Parallel,
    device: torch.device,
    compute: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """DDP replicates the module and averages gradients; FSDP2 shards its parameters and optimizer
    state.

    compute: the run's autocast dtype. Under FSDP2 the head's parameters are gathered in it
        (bfloat16: half
    the traffic) and its gradients reduced in float32 (`MixedPrecisionPolicy`), so the head computes
    in one dtype as under DeepSpeed's bf16; DDP keeps float32 parameters under autocast, and flex
    attention gets q, k and v in the autocast dtype (train/ttt_flex.py)."""
    if par.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None
        )
    if par.backend == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(
            param_dtype=None if compute == torch.float32 else compute, reduce_dtype=torch.float32
        )
        return fully_shard(module, mp_policy=policy)
    return module


def shard_target(model: torch.nn.Module, device: Optional[torch.device] = None) -> None:
    """FSDP2 over each decoder layer of the frozen target: every rank keeps 1/world_size of their
    weights and gathers a layer's weights just for its forward, freeing them after it
    (`reshard_after_forward=True`: a layer with no FSDP parent is its own root, which by default
    keeps its gathered weights after a forward, and the target runs without a backward that would
    free them). The embedding, final norm and lm_head stay whole on every rank (the head reads
    them). `model` may be on the CPU: each layer's shard moves to `device` as it is sharded, and the
    rest after, so the whole target never sits on one GPU."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise HeadwayError(
            f"train.shard_target: {type(model).__name__} has no model.layers to shard; "
            "set train.shard_target=false"
        )
    mesh = None
    if device is not None and device.type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    if device is not None:
        model.to(device)
    log.info(
        "target: %d decoder layers sharded across %d ranks", len(layers), dist.get_world_size()
    )


def held_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of `model`'s parameters this rank holds now, bytes of the whole model): a sharded
    layer counts its local shard while resharded, its whole weights while gathered."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for p in model.parameters():
        size = p.element_size()
        whole += p.numel() * size
        held += (p.to_local() if isinstance(p, DTensor) else p).numel() * size
    return held, whole


def full_state(module: torch.nn.Module, optimizer: Any, par: Parallel) -> tuple[dict, dict]:
    """The whole model and optimizer state, gathered to rank 0 on CPU (every rank must call
    this)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=par.active)
    return (
        get_model_state_dict(module, options=options),
        get_optimizer_state_dict(module, optimizer, options=options),
    )


def load_full_state(
    module: torch.nn.Module, optimizer: Any, model_state: dict, optim_state: dict, par: Parallel
) -> None:
    """Load a full (gathered) state into the possibly sharded module and optimizer on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, model_state, options=options)
    set_optimizer_state_dict(module, optimizer, optim_state, options=options)


class TorchStep:
    """Backward and optimizer step for ddp, fsdp and one process: each micro-batch's loss is scaled
    by 1/grad_accum; the step averages the LoRA adapters' gradients (outside the wrapped head),
    clips and steps the optimizer and the schedule."""

    def __init__(
        self,
        optimizer: Any,
        scheduler: Any,
        params: list,
        lora_params: list,
        grad_clip: float,
        grad_accum: int,
        par: Parallel,
    ):
        self.optimizer, self.scheduler, self.par = optimizer, scheduler, par
        self.params, self.lora_params = params, lora_params
        self.grad_clip, self.grad_accum = grad_clip, grad_accum

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulating(self, module: torch.nn.Module, last: bool) -> Any:
        """The context a micro-batch's forward and backward run in: before the last micro-batch of
        an accumulation, DDP keeps its gradients local (`no_sync`) and FSDP2 skips its
        reduce-scatter, so gradients cross ranks once per optimizer step."""
        if last or self.grad_accum == 1:
            return contextlib.nullcontext()
        if hasattr(module, "no_sync"):
            return module.no_sync()
        if hasattr(module, "set_requires_gradient_sync"):
            return _FsdpNoSync(module)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> torch.Tensor:
        """Clip and step; returns the gradient norm before clipping, a 0-dim tensor on the device (0
        when clipping is off), not read here."""
        self.par.all_reduce_grads(self.lora_params)
        norm = torch.zeros((), device=self.par.device)
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params + self.lora_params, self.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        return norm.detach()


class _FsdpNoSync:
    """FSDP2's no_sync: gradients stay unsharded and unreduced until the accumulation's last
    backward."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc: Any) -> None:
        self.module.set_requires_gradient_sync(True)
