"""The fused op's two PCIe implementations timed side by side on one job shape, per token bucket (collective).

`compare_pcie_paths(group, hidden, dtype, max_tokens, profile, tune_cache)` makes both workspaces (FlashInfer's
PCIe all-reduce for `max_tokens`, as the job makes it, so that it runs the tuned configurations of `tune_cache`,
and the one-kernel path's), then for each
bucket (1, 2, 4, ... up to `max_tokens` and the one-kernel workspace's capacity) replays CUDA graphs of the
two-kernel path (the all-reduce, then the fused add-RMSNorm kernel, as `PciePlan` runs them) and of the one
kernel, interleaved (`fxfuse.bench.replay.replay_timings`), and returns {tokens: (two-kernel us, one-kernel us)},
each the slowest rank's median (an all-reduce MAX over the group, so every rank returns the same numbers).
Every rank must call it with the same arguments. Ranks sharing one GPU give correct calls and meaningless
times: measure on one GPU per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.bench.replay import replay_timings
from fxfuse.op.decide.agreement import collective_device
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
from fxfuse.op.kernels.one_shot_all_reduce_norm import Epilogue
from fxfuse.op.runtime.one_kernel_pcie import ONE_KERNEL_MAX_TOKENS, OneKernelPcieKernels
from fxfuse.op.runtime.pcie_kernels import PcieAllReduceKernels

#: Replay rounds per bucket and calls per graph.
REPEATS, ITERS = 15, 50
EPS = 1e-6


def buckets(max_tokens: int) -> list[int]:
    """Powers of two up to `max_tokens` and the one-kernel workspace's capacity (that bound itself included)."""
    top = min(max_tokens, ONE_KERNEL_MAX_TOKENS)
    counts = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return counts if counts[-1] == top else counts + [top]


def compare_pcie_paths(group: dist.ProcessGroup, hidden: int, dtype: torch.dtype, max_tokens: int, profile: str | None,
                       tune_cache: str | None) -> dict[int, tuple[float, float]]:
    """{tokens: (two-kernel us, one-kernel us)} per bucket, the slowest rank's medians (module docstring)."""
    counts = buckets(max_tokens)
    pcie, one = PcieAllReduceKernels(), OneKernelPcieKernels()
    # the job's size: FlashInfer keys its tuned configurations by the workspace's size
    two_workspace = pcie.create_workspace(group, max_tokens, hidden, dtype, profile, tune_cache)
    try:
        one_workspace = one.create_workspace(group, counts[-1], hidden)
        try:
            timings = {tokens: _time_bucket(pcie, two_workspace, one, one_workspace, tokens, hidden, dtype, group)
                       for tokens in counts}
        finally:
            torch.cuda.synchronize()
            one.destroy_workspace(one_workspace, group)
    finally:
        pcie.destroy_workspace(two_workspace, group)
    return timings


def _time_bucket(pcie, two_workspace, one, one_workspace, tokens: int, hidden: int, dtype, group) -> tuple[float, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    reduced, normed, residual_out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def two_kernels():
        pcie.all_reduce(two_workspace, x, reduced)
        add_rmsnorm_into(reduced, residual, weight, EPS, reduced, normed)

    def one_kernel():
        one.run(one_workspace, x, Epilogue.NORM, residual=residual, weight=weight, eps=EPS, residual_out=residual_out,
                normed=normed)

    medians = replay_timings({"two": two_kernels, "one": one_kernel}, REPEATS, ITERS)
    slowest = torch.tensor([medians["two"][0], medians["one"][0]], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest[0]), float(slowest[1])
