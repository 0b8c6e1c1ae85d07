"""What a process started by torchrun is told, read without torch: whether it is one, and how many ranks.

torchrun (or any launcher that sets RANK, WORLD_SIZE and MASTER_ADDR) starts one process per rank and
tells each the world size; `fxfuse.runner.launch.run_on_ranks` then joins that launch instead of spawning.
`check_tp_matches_launch(tp, flag)` refuses a tensor-parallel size that disagrees with it, before any
work, where it would otherwise run silently at the launch's size; `launched_world_size()` is that size
(None outside such a launch), the default of a `--tp` the user did not give.
"""

from __future__ import annotations

import os
from typing import Mapping

from fxfuse.runner.errors import RunError


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """True when this process was started by torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR)."""
    return "RANK" in environ and "WORLD_SIZE" in environ and "MASTER_ADDR" in environ


def launched_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """The launch's world size (WORLD_SIZE) under torchrun, else None; RunError if it is not a positive integer."""
    if not under_torchrun(environ):
        return None
    try:
        size = int(environ["WORLD_SIZE"])
    except ValueError:
        size = 0
    if size < 1:
        raise RunError(f"WORLD_SIZE={environ['WORLD_SIZE']!r} (set by torchrun or another launcher): expected a positive integer")
    return size


def check_tp_matches_launch(tp: int, flag: str = "--tp", environ: Mapping[str, str] = os.environ) -> None:
    """RunError when this process is one of a torchrun launch whose world size is not `tp`: each process is
    one rank, so the launch decides how many there are."""
    size = launched_world_size(environ)
    if size is not None and size != tp:
        raise RunError(f"{flag} {tp}, but torchrun started {size} processes (WORLD_SIZE={size}) and each is one rank: "
                       f"give {flag} {size}, or start {tp} (torchrun --nproc-per-node {tp})")
