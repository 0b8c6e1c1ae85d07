"""Rank agreement: the small collectives by which every rank of a group takes the same branch.

Any choice that decides which collective a rank issues next (fused kernel or NCCL, workspace or
none, run or raise) must be taken identically on every rank, or the group hangs. The rule that keeps
it so: a rank never raises between two exchanges. Each local step that can fail (reading settings,
probing the GPU, importing or compiling kernels, allocating) runs inside `LocalSteps`, which keeps the
first failure, with the step's name, instead of raising it; the next exchange (`exchange`,
`agreed_failure`) carries it to every rank, and every rank then raises the same `RankStepFailed`, or
takes the same fallback, naming the rank and the step.

`gather_objects` (everyone's value), `all_ranks_agree` (an ok flag and a configuration checksum in one
all_reduce) and `fingerprint` (the checksum) are the primitives. They are host-synchronizing
collectives: call them outside CUDA-graph capture.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
#: A failed local step: (step name, "ExceptionType: message").
StepFailure = tuple[str, str]


class ConfigMismatch(RuntimeError):
    """Ranks of one group disagree on something every rank must see the same (settings, thresholds,
    FlashInfer version, GPU arch, tuning file); raised with the same message on every rank."""


class RankStepFailed(RuntimeError):
    """A local step of the fused op's set-up failed on some rank(s); raised on every rank of the group
    with the same message, which names each failing rank and its step."""


class LocalSteps:
    """One rank's local steps before an exchange. `run(step, fn, ...)` calls `fn` unless an earlier
    step failed; an exception is kept as `failure` = (step, error) instead of raised, so that it
    reaches the other ranks through the exchange that follows."""

    def __init__(self) -> None:
        self.failure: StepFailure | None = None

    def run(self, step: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """`fn(*args, **kwargs)`, or None if it (or an earlier step) failed."""
        if self.failure is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure travels through the next exchange
            self.failure = (step, f"{type(exc).__name__}: {exc}")
            return None


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


def describe_failures(failures: list[StepFailure | None]) -> str | None:
    """'rank r, <step>: <error>; ...' for the ranks (by index) whose entry is a failure, ranks with the
    same failure named together ('ranks 0, 1, <step>: <error>'); None if no rank failed."""
    ranks_by_failure: dict[StepFailure, list[int]] = {}
    for rank, failure in enumerate(failures):
        if failure is not None:
            ranks_by_failure.setdefault(tuple(failure), []).append(rank)
    named = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, {step}: {error}"
             for (step, error), ranks in ranks_by_failure.items()]
    return "; ".join(named) or None


def agreed_failure(failure: StepFailure | None, group: dist.ProcessGroup, request: Any = None) -> str | None:
    """One exchange: None on every rank if no rank failed and all passed an equal `request`, else the
    same sentence on every rank naming each failing rank and step (or the differing requests)."""
    gathered = gather_objects((failure, request), group)
    failed = describe_failures([f for f, _ in gathered])
    if failed is not None:
        return failed
    if len({repr(r) for _, r in gathered}) > 1:
        return "the ranks asked for different things: " + ", ".join(f"rank {i}={r!r}" for i, (_, r) in enumerate(gathered))
    return None


def exchange(value: Any, steps: LocalSteps, group: dist.ProcessGroup, what: str) -> list[Any]:
    """Every rank's `value` (collective), or `RankStepFailed` raised identically on every rank when a
    rank's `steps` failed; `what` names the set-up in the message."""
    gathered = gather_objects((value, steps.failure), group)
    failed = describe_failures([f for _, f in gathered])
    if failed is not None:
        raise RankStepFailed(f"{what} failed on every rank of process group {group.group_name!r} because of {failed}")
    return [v for v, _ in gathered]


def mismatches(reports: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    """For each of `keys` on which the ranks' `reports` differ: every rank's value, in rank order."""
    return {key: [r[key] for r in reports] for key in keys if len({repr(r[key]) for r in reports}) > 1}
