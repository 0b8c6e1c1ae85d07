"""Timing GPU work the way every one-GPU benchmark here does: CUDA-graph replay, variants interleaved.

`replay_timings({name: call}, repeats, iters)` captures `iters` calls of each zero-argument callable in
one CUDA graph (after warm-up calls on a side stream, so compilation and allocator growth happen
outside capture), replays each graph once, then `repeats` rounds that replay every graph in turn,
timed with CUDA events; it returns {name: (median, p25, p75)} in microseconds per call.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

WARMUP_CALLS = 3


def replay_timings(calls: dict[str, Callable[[], object]], repeats: int, iters: int) -> dict[str, tuple[float, float, float]]:
    """(median, p25, p75) microseconds per call of each callable, from interleaved CUDA-graph replays."""
    graphs = {}
    for name, call in calls.items():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_CALLS):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                call()
        graphs[name] = graph
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    samples = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000 / iters)
    del graphs
    out = {}
    for name, values in samples.items():
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
        out[name] = (statistics.median(values), q1, q3)
    return out
