"""Rank agreement: the small collectives by which every rank of a group takes the same branch.

Any choice that decides which collective a rank issues next (fused kernel or NCCL, workspace or
none) must be taken identically on every rank, or the group hangs. These helpers exchange what each
rank knows, so that all ranks decide from the same data: `gather_objects` (everyone's value),
`all_ranks_agree` (an ok flag and a configuration checksum in one all_reduce), `fingerprint` (the
checksum). They are host-synchronizing collectives: call them outside CUDA-graph capture.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist


class ConfigMismatch(RuntimeError):
    """Ranks of one group disagree on something every rank must see the same (settings, thresholds,
    FlashInfer version, GPU arch, tuning file); raised with the same message on every rank."""


def fingerprint(*values: Any) -> int:
    """A 31-bit checksum of `values`' reprs, compared across ranks to detect disagreeing configs."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small tensor must live for a collective on `group` (CPU for gloo, else the GPU)."""
    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_ranks_agree(ok: bool, config_fingerprint: int, group: dist.ProcessGroup) -> bool:
    """True on every rank iff every rank passed `ok` and the same fingerprint (one all_reduce)."""
    flags = torch.tensor([int(ok), config_fingerprint, -config_fingerprint], dtype=torch.int64)
    flags = flags.to(collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    all_ok, lowest, minus_highest = flags.tolist()
    return all_ok == 1 and lowest == -minus_highest


def gather_objects(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's `value` (picklable), in group rank order, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def mismatches(reports: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """For each of `keys` on which the ranks' `reports` differ: every rank's value, in rank order."""
    return {key: [r[key] for r in reports] for key in keys if len({repr(r[key]) for r in reports}) > 1}
