"""A plain progress display for long phases (loading weights, compiling, capturing CUDA graphs).

`Progress(enabled, label)` writes one line to stderr when a phase starts and one when it ends,
each stamped with the seconds since the display was created. Only one rank should enable it
(rank 0), so the lines of several processes never interleave.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, TextIO


class Progress:
    """Timestamped phase lines on a stream (stderr by default); silent when not enabled."""

    def __init__(self, enabled: bool, label: str, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.label = label
        self.stream = stream
        self.start = time.monotonic()

    def note(self, message: str) -> None:
        """Write one line: `<label> [   12.3s] <message>`."""
        if self.enabled:
            elapsed = time.monotonic() - self.start
            print(f"{self.label} [{elapsed:7.1f}s] {message}", file=self.stream or sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, message: str) -> Iterator[None]:
        """Note `message ...` now and `message: done in X s` when the block ends without error."""
        self.note(f"{message} ...")
        began = time.monotonic()
        yield
        self.note(f"{message}: done in {time.monotonic() - began:.1f}s")
