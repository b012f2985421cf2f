"""A fake CUDA device on a CPU-only torch, to run the real GPU code paths with `device="cuda"`.

Under `FakeTensorMode(allow_non_fake_inputs=True)` a tensor created on "cuda" is a fake tensor: its
ops run on shapes only, `.item()` raises `DataDependentOutputException`, `nonzero()` raises, and a
CPU tensor mixed into a CUDA op raises `FakeTensorDeviceMismatchError`. What a CPU-only build lacks
is a CUDA device guard, which slicing, copies and `.to("cuda")` ask for before they reach the fake
tensors; a no-op guard (one C++ registration, built once per machine in about 20 s) fills that gap.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

_GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
namespace {
// Device 0 is always current; nothing is ever set, synchronised or streamed: the tensors are fake.
struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
}  // namespace
int registered() { return 1; }
"""
_loaded = False


def install_guard() -> None:
    """Register the no-op CUDA device guard in this process (a no-op on a CUDA build)."""
    global _loaded
    if _loaded or torch.backends.cuda.is_built():
        return
    from torch.utils.cpp_extension import load_inline

    build = (
        Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))
        / "fake_cuda_guard"
    )
    build.mkdir(parents=True, exist_ok=True)
    load_inline(
        "headway_fake_cuda_guard",
        cpp_sources=_GUARD,
        functions=["registered"],
        build_directory=str(build),
    )
    _loaded = True


def to_fake_cuda(*modules: torch.nn.Module) -> None:
    """Move `modules` onto the fake CUDA device (inside `fake_cuda()`), in place: each parameter,
    buffer and plain tensor attribute (a head's reference to the target's embedding, say) becomes a
    fake CUDA tensor; a tensor shared within or across the modules stays shared."""
    cuda = torch.device("cuda", 0)
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            moved = t.detach().to(cuda)
            made[id(t)] = (
                torch.nn.Parameter(moved, t.requires_grad)
                if isinstance(t, torch.nn.Parameter)
                else moved
            )
        return made[id(t)]

    for module in modules:
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, t in list(table.items()):
                    if t is not None:
                        table[name] = fake(t)
            for name, t in list(vars(owner).items()):
                if isinstance(t, torch.Tensor):
                    setattr(owner, name, fake(t))


@contextmanager
def fake_cuda() -> Iterator[torch._subclasses.fake_tensor.FakeTensorMode]:
    """Inside the block, tensors made on or moved to "cuda" are fake CUDA tensors (`to_fake_cuda`
    moves a module)."""
    from torch._subclasses import fake_tensor

    install_guard()
    # a one-element constant made inside the block (torch.tensor([[token]])) is otherwise kept as a
    # real constant, whose ops run for real: its move to "cuda" would reach the CPU build's missing
    # CUDA kernels
    limit, fake_tensor.CONSTANT_NUMEL_LIMIT = fake_tensor.CONSTANT_NUMEL_LIMIT, 0
    try:
        with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit
