"""Timing GPU work the way every one-GPU benchmark here does: CUDA-graph replay, variants interleaved.

`replay_timings({name: call}, repeats, iters)` captures `iters` calls of each zero-argument callable in
one CUDA graph (after warm-up calls on a side stream, so compilation and allocator growth happen
outside capture), replays each graph once, then `repeats` rounds that replay every graph in turn,
timed with CUDA events; it returns {name: (median, p25, p75)} in microseconds per call.
`interleaved_wall_us({name: call}, calls)` times host cost the same way, without graphs: wall time
of `calls` back-to-back uncaptured calls, every callable in turn per round.
"""

from __future__ import annotations

import statistics
import time
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
    return {name: median_quartiles(values) for name, values in samples.items()}


def interleaved_wall_us(calls: dict[str, Callable[[], object]], calls_per_sample: int, rounds: int = 15) -> dict[str, tuple[float, float, float]]:
    """(median, p25, p75) wall microseconds per call of `calls_per_sample` back-to-back uncaptured calls
    of each callable, over `rounds` rounds that time every callable in turn (after warm-up calls), so
    that a slow spell of the host falls on all of them alike."""
    for call in calls.values():
        for _ in range(10):
            call()
    torch.cuda.synchronize()
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            began = time.perf_counter()
            for _ in range(calls_per_sample):
                call()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - began) * 1e6 / calls_per_sample)
    return {name: median_quartiles(values) for name, values in samples.items()}


def median_quartiles(values: list[float]) -> tuple[float, float, float]:
    """(median, p25, p75) of the samples (all three the sample itself when there is one)."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return statistics.median(values), q1, q3
