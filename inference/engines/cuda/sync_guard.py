"""Counting a decoding loop's host reads and its uploads, on any device: the CUDA backend's budget
is one device-to-host read per speculative step and none inside a captured step.

`HostReads` is a TorchFunctionMode: it sees every `tolist`, `item`, `int()`, `float()`, `bool()` and
`numpy()` of a tensor, which a CPU tensor's reads never show to the dispatcher, and `.cpu()` /
`.to("cpu")` of a device tensor. `Uploads` is a TorchDispatchMode: it sees copies from the host onto
another device. Both run under `FakeTensorMode` too (fake CUDA), where a read that escapes them
raises instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# the tensor methods that hand a value to Python
READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy"}


class HostReads(TorchFunctionMode):
    """Counts host reads (`count`, and by kind in `kinds`) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.kinds: dict[str, int] = {}

    def _add(self, kind: str) -> None:
        self.count += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self._add(name)
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            wants_cpu = name == "cpu" or any(
                str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")] if a is not None
            )
            if src.device.type != "cpu" and wants_cpu:
                self._add("to_host")
        return func(*args, **kwargs)


class Uploads(TorchDispatchMode):
    """Counts host-to-device copies (`count`) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_") and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" else args[0]
            dst = out if name == "_to_copy" else args[0]
            if (
                isinstance(src, torch.Tensor)
                and src.device.type == "cpu"
                and dst.device.type != "cpu"
            ):
                self.count += 1
        return out
