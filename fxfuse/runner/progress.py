"""A plain progress display for long phases (loading weights, compiling, tracing, capturing CUDA graphs).

`Progress(enabled, label)` writes one line to stderr when a phase starts and one when it ends,
each stamped with the seconds since the display was created; a phase given `heartbeat_s` also
says every `heartbeat_s` seconds that it is still running. `count(message, done, total)` reports
countable work (`3/8`), at most one line every `min_interval_s` seconds (the last one always).
`watch_layers(progress, layers, message)` counts the layers dynamo traces while it compiles a
model. Only one rank should enable it (rank 0), so the lines of several processes never
interleave. Importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Sequence, TextIO


class Progress:
    """Timestamped phase lines on a stream (stderr by default); silent when not enabled."""

    def __init__(self, enabled: bool, label: str, stream: TextIO | None = None, min_interval_s: float = 2.0) -> None:
        self.enabled = enabled
        self.label = label
        self.stream = stream
        self.min_interval_s = min_interval_s
        self.start = time.monotonic()
        self._last_count = float("-inf")
        self._lock = threading.Lock()

    def note(self, message: str) -> None:
        """Write one line: `<label> [   12.3s] <message>`, in one write (`print` makes two, text then
        newline: on an unbuffered stream, as stderr is under PYTHONUNBUFFERED, a process stopped between
        them left the launcher's last line glued to a rank's unfinished one)."""
        if self.enabled:
            elapsed = time.monotonic() - self.start
            stream = self.stream or sys.stderr
            with self._lock:
                stream.write(f"{self.label} [{elapsed:7.1f}s] {message}\n")
                stream.flush()

    def count(self, message: str, done: int, total: int) -> None:
        """Note `message done/total`: the first and last call always, others at most once per
        `min_interval_s` seconds."""
        now = time.monotonic()
        if done in (1, total) or now - self._last_count >= self.min_interval_s:
            self._last_count = now
            self.note(f"{message} {done}/{total}")

    @contextlib.contextmanager
    def phase(self, message: str, heartbeat_s: float | None = None) -> Iterator[None]:
        """Note `message ...` now, `message: still running (N s)` every `heartbeat_s` seconds if
        given, and `message: done in X s` when the block ends without error."""
        self.note(f"{message} ...")
        began = time.monotonic()
        stop = threading.Event()
        beat = None
        if self.enabled and heartbeat_s:
            def heartbeat() -> None:
                while not stop.wait(heartbeat_s):
                    self.note(f"{message}: still running ({time.monotonic() - began:.0f} s)")

            beat = threading.Thread(target=heartbeat, name="fxfuse-progress", daemon=True)
            beat.start()
        try:
            yield
        finally:
            stop.set()
            if beat is not None:
                beat.join()
        self.note(f"{message}: done in {time.monotonic() - began:.1f}s")


def watch_layers(progress: Progress, layers: Sequence, message: str) -> list:
    """Count, on `progress`, the modules of `layers` that dynamo traces while compiling (`message i/N`).

    Each layer gets a forward pre-hook that calls `torch._dynamo.comptime`: dynamo runs it while
    tracing that layer (adding nothing to the graph); eager calls do nothing. Returns the hook
    handles. Nothing is registered when `progress` is disabled or comptime is missing.
    """
    if not progress.enabled:
        return []
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:
        return []
    total = len(layers)
    return [layer.register_forward_pre_hook(_layer_hook(comptime, progress, message, i + 1, total))
            for i, layer in enumerate(layers)]


def _layer_hook(comptime, progress: Progress, message: str, index: int, total: int):
    """A forward pre-hook whose comptime callback counts layer `index` of `total` as traced."""

    def traced(ctx) -> None:  # runs inside dynamo, while it traces the layer
        progress.count(message, index, total)

    def hook(module, args) -> None:
        comptime(traced)

    return hook
