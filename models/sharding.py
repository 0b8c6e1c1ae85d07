"""How a model parameter maps onto a Hugging Face checkpoint tensor and which slice a rank holds.

Parallel layers tag each parameter with `tp_shard_dim`: the dimension of the *checkpoint* tensor
that is split evenly across ranks in rank order (None: every rank holds the whole tensor). The
checkpoint loader and the random-weight initializer read only these tags, so the model code alone
decides the sharding.
"""

from __future__ import annotations

import torch

SHARD_ATTR = "tp_shard_dim"


def mark_shard(param: torch.nn.Parameter, dim: int | None) -> torch.nn.Parameter:
    """Tag `param` as split along checkpoint dimension `dim` across ranks (None: replicated)."""
    setattr(param, SHARD_ATTR, dim)
    return param


def shard_dim(param: torch.Tensor) -> int | None:
    """The checkpoint dimension `param` is split along, or None if replicated (untagged: replicated)."""
    return getattr(param, SHARD_ATTR, None)


def shard_range(full_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's even slice of a dimension of `full_size` (must divide evenly)."""
    if full_size % world_size:
        raise ValueError(f"tensor parallel size {world_size} does not divide dimension of size {full_size}")
    part = full_size // world_size
    return rank * part, (rank + 1) * part
