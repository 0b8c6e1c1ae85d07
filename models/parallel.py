"""Tensor-parallel context: the process group a model shards over, passed explicitly (no globals).

Every all_reduce in the reference models goes through `ParallelContext.all_reduce`, which uses
functional collectives (`torch.distributed._functional_collectives`), so the traced graph always
has one canonical shape: `_c10d_functional.all_reduce -> _c10d_functional.wait_tensor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch >= 2.13 renamed all_gather_tensor (now a deprecated alias) to all_gather_single.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class ParallelContext:
    """Which slice of a tensor-parallel model this process holds, and the group to reduce over.

    `group` is None for a single, unsharded process (world_size 1); collectives are then no-ops, as
    they are for a one-rank group unless `collectives_at_one_rank` (benchmarks that time real one-rank
    all-reduces on a single GPU set it).
    """

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    collectives_at_one_rank: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of world size {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a process group is required when world_size > 1")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> "ParallelContext":
        """Context for the given (or default) initialized process group."""
        group = group if group is not None else dist.group.WORLD
        return cls(rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group)

    def shard(self, size: int, what: str) -> int:
        """Size of this rank's shard of a dimension of `size`; raises if tp does not divide it."""
        if size % self.world_size:
            raise ValueError(f"tensor parallel size {self.world_size} does not divide {what} ({size})")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (out of place); identity when world_size is 1 (unless
        `collectives_at_one_rank` and there is a group)."""
        if self.world_size == 1 and not (self.collectives_at_one_rank and self.group is not None):
            return x
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (rank order); identity for one rank."""
        if self.world_size == 1:
            return x
        gathered = _all_gather(x.contiguous(), 0, self.group)
        chunks = gathered.chunk(self.world_size, dim=0)
        return torch.cat(chunks, dim=-1)
