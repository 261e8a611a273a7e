"""The TSP group: the D ranks that share one model replica (weights AND tokens sharded over them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

import lightning_tsp.teardown  # noqa: F401  (imports torch.distributed.nn.functional before any group exists)


@dataclass(frozen=True)
class TSPGroup:
    """A process group plus this rank's place in it. Passed explicitly to every layer and schedule.

    ``group is None`` means D = 1 without any process group: the layers then issue no collective and
    compute the unsharded model.
    """

    group: ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def single(cls) -> "TSPGroup":
        return cls(None, 0, 1)

    @classmethod
    def from_process_group(cls, group: ProcessGroup) -> "TSPGroup":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of member ``group_rank`` (collectives take global ranks for src/dst/peer)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
