"""Where this process stands in a launched job (torchrun, deepspeed), read from the launcher's
environment.

Torch-free, so that the command line can set up its logging before it decides whether to load torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in a torchrun launch (rank 0 of 1 when launched alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Read the launcher's environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE)."""
    env = os.environ
    return DistInfo(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
    )
