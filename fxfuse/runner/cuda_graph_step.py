"""Replay a model step from CUDA graphs captured once per step-width bucket.

`CudaGraphStep(step, batch, widths, device)` captures `step(input_ids, positions)` for each
width (tokens per sequence) in `widths` into its own `torch.cuda.CUDAGraph` with static input
buffers; calling it copies the inputs into the buffers of the matching width and replays. Widths
(or batch sizes) without a graph run the step uncaptured. Capture must happen before real tokens
are in the KV cache: the warm-up and capture calls write the cache at positions 0..width-1, which
the prefill overwrites. The warm-up calls (outside capture) are where a compiled step compiles,
and where the fxfuse op creates its workspace if `fxfuse.prepare` was not called first.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from fxfuse.runner.progress import Progress


class CudaGraphStep:
    """A model step that replays captured CUDA graphs for the widths it was captured for."""

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        batch: int,
        widths: Iterable[int],
        device: torch.device,
        warmup: int = 2,
        progress: Progress | None = None,
    ):
        self.step = step
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        widths = sorted(set(widths))
        for count, width in enumerate(widths, 1):
            if progress is not None:
                progress.note(f"capturing a CUDA graph for {batch} x {width} tokens ({count}/{len(widths)})")
            ids = torch.zeros(batch, width, dtype=torch.long, device=device)
            positions = torch.arange(width, device=device).expand(batch, -1).contiguous()
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    step(ids, positions)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step(ids, positions)
            self.graphs[width] = (graph, ids, positions, out)
        torch.cuda.synchronize(device)

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths that have a captured graph, ascending."""
        return tuple(self.graphs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run one step: replay the graph for this width (returns its static output) or run uncaptured."""
        entry = self.graphs.get(input_ids.shape[1])
        if entry is None or entry[1].shape[0] != input_ids.shape[0]:
            return self.step(input_ids, positions)
        graph, ids, pos, out = entry
        ids.copy_(input_ids)
        pos.copy_(positions)
        graph.replay()
        return out
