"""The static engines' KV cache: one preallocated tensor the engine owns, for every layer's keys and
values.

One tensor [layers, 2, kv_heads, max_len, head_dim] rather than a pair per layer, so that keeping a
verified tree's accepted path is one gather and one copy over every layer at once (as Medusa's
reference code compacts its `past_key_values_data`), not two copies per layer. Each layer's keys and
values are contiguous views of it ([kv_heads, max_len, head_dim]), which the layer step and the C++
layer loop write in place.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer in one tensor `data` [layers, 2, kv_heads, max_len, head_dim];
    `k[i]`, `v[i]` are layer i's views. The cache holds no length: its runner does (on the host, or
    as a device tensor for the CUDA backend)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.data = torch.zeros(layers, 2, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.k = [self.data[i, 0] for i in range(layers)]
        self.v = [self.data[i, 1] for i in range(layers)]

    @property
    def max_len(self) -> int:
        return self.data.shape[3]

    def fits(
        self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device
    ) -> bool:
        """Whether this cache serves a runner of these sizes (at least `max_len` slots), dtype and
        device."""
        d = self.data
        return (
            d.shape[0] == layers
            and d.shape[2] == kv_heads
            and d.shape[4] == head_dim
            and d.shape[3] >= max_len
            and d.dtype == dtype
            and d.device == torch.device(device)
        )

    def compact(self, first: int | torch.Tensor, src: torch.Tensor) -> None:
        """Move the entries at slots `src` [k] (ascending, each >= first) to slots first..first+k-1,
        in every layer, in one gather and one copy. `first` may be a device tensor (0-d): then the
        destination is `first + arange(k)`, written by index, so no host number is frozen into a
        captured step."""
        gathered = self.data.index_select(3, src)
        if isinstance(first, torch.Tensor):
            dest = first + torch.arange(src.shape[0], device=src.device)
            self.data.index_copy_(3, dest, gathered)
        else:
            self.data[:, :, :, first : first + src.shape[0]] = gathered
