"""One workspace serves one CUDA stream at a time: the rule both peer-to-peer all-reduces follow.

A workspace whose calls must stay totally ordered (FlashInfer's PCIe all-reduce, the one-kernel PCIe path's
generation counter) records the stream its last uncaptured call ran on. A call from another stream (CUDA-graph
warm-up runs on a side stream) first makes the new stream wait for the old one's work, then rebinds. During
capture nothing changes: the captured calls replay on the stream the graph is replayed on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def bind_to_current_stream(workspace, rebind: Callable[[], None] | None = None) -> None:
    """Order this call after the work of the stream `workspace.stream` last ran on, call `rebind` (if any)
    when the stream changes, and record the current stream; nothing during CUDA-graph capture."""
    if torch.cuda.is_current_stream_capturing():
        return
    current = torch.cuda.current_stream()
    if workspace.stream is not None and current != workspace.stream:
        current.wait_stream(workspace.stream)  # the old stream's calls finish before this one starts
        if rebind is not None:
            rebind()
    workspace.stream = current
