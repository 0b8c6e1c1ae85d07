"""FlashInfer's PCIe IPC all-reduce (`flashinfer.comm.PcieIpcAllReduceWorkspace`, FlashInfer >= 0.7.2).

The PCIe implementation of the fused op is this all-reduce followed by the fused add + RMSNorm kernel
(`fxfuse.op.kernels.add_rmsnorm_kernel`). FlashInfer's rules for the workspace are strict, and this adapter
keeps them:
- creation, launch-configuration resolution and destruction are collectives that every rank makes
  with the same arguments in the same order (the registry in `fxfuse.op.runtime.workspace` agrees on
  creation first);
- the workspace is sized to the workload (`max_tokens * hidden` elements: its epoch halves sit
  world_size x that apart), and one workspace serves one hidden size and dtype;
- launch configurations are resolved for every token count up to `max_tokens` when the workspace is
  made (FlashInfer's `prepare`, outside capture), then passed explicitly on every call, so a captured
  call never needs the collective a lazy resolution would run;
- one workspace serves one CUDA stream: when a call comes on another stream (CUDA-graph warm-up runs
  on a side stream), the new stream first waits for the old one's work, then the workspace is rebound,
  so the calls stay totally ordered, as FlashInfer requires.
Tuned launch configurations are read from the tuning file at creation (`fxfuse tune pcie` writes it);
all ranks must read the same file, which `fxfuse.op.decide.group_config` checks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxfuse.op.runtime.stream_order import bind_to_current_stream

#: Upper bound of FlashInfer's per-rank PCIe workspace, for the free-memory check before creation.
PCIE_SLACK_BYTES = 16 << 20


def pcie_workspace_bytes(world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """A generous upper bound of one rank's PCIe workspace: its double-buffered staging for every
    rank's share (2 x world_size x max_numel elements) plus flags and slack."""
    return 2 * world_size * max_tokens * hidden_size * dtype.itemsize + PCIE_SLACK_BYTES


@dataclass
class PcieWorkspace:
    """FlashInfer's workspace, the launch configuration per token count, and the stream it is bound to."""

    library_workspace: Any
    hidden_size: int
    dtype: torch.dtype
    configs: list  # index = token count; None where the kernels cannot run that shape
    stream: torch.cuda.Stream | None = field(default=None)


class PcieAllReduceKernels:
    """Loads FlashInfer's PCIe all-reduce lazily and runs it on `PcieWorkspace`s."""

    def __init__(self) -> None:
        self._comm: Any = None

    def load(self) -> None:
        """Import flashinfer.comm and check it has the PCIe all-reduce (raises RuntimeError if not)."""
        if self._comm is None:
            comm = importlib.import_module("flashinfer.comm")
            if not hasattr(comm, "PcieIpcAllReduceWorkspace"):
                raise RuntimeError("this flashinfer has no PcieIpcAllReduceWorkspace (needs >= 0.7.2)")
            self._comm = comm

    def create_workspace(
        self, group: dist.ProcessGroup, max_tokens: int, hidden_size: int, dtype: torch.dtype,
        profile: str | None, tune_cache: str | None,
    ) -> PcieWorkspace:
        """Build FlashInfer's workspace for up to `max_tokens` tokens of `hidden_size` (collective) and
        resolve the launch configuration of every token count 1..max_tokens (collective)."""
        self.load()
        workspace = self._comm.PcieIpcAllReduceWorkspace(
            group=group, max_numel=max_tokens * hidden_size, dtype=dtype, profile=profile, tune_cache=tune_cache,
        )
        try:
            resolved = workspace.prepare([(t, hidden_size) for t in range(1, max_tokens + 1)], dtype=dtype)
        except Exception:
            workspace.destroy()
            raise
        configs = [None] + [resolved[(t, hidden_size)] for t in range(1, max_tokens + 1)]
        return PcieWorkspace(workspace, hidden_size, dtype, configs)

    def supports(self, workspace: PcieWorkspace, num_tokens: int) -> bool:
        """Whether the kernels run `num_tokens` tokens (the same answer on every rank)."""
        return 0 < num_tokens < len(workspace.configs) and workspace.configs[num_tokens] is not None

    def all_reduce(self, workspace: PcieWorkspace, x: torch.Tensor, out: torch.Tensor) -> None:
        """Sum contiguous [tokens, hidden] `x` over the group into `out` (stream-ordered, capturable)."""
        bind_to_current_stream(workspace, workspace.library_workspace.rebind_stream)
        workspace.library_workspace.all_reduce(x, out=out, config=workspace.configs[x.shape[0]])

    def destroy_workspace(self, workspace: PcieWorkspace, group: dist.ProcessGroup) -> None:
        """Free the workspace (collective: every rank calls it)."""
        workspace.library_workspace.destroy()

    def release_workspace(self, workspace: PcieWorkspace) -> None:
        """Nothing can be freed without peers (FlashInfer's teardown has barriers): process exit frees it."""

    def tune(self, workspace: PcieWorkspace, path: str | None) -> dict:
        """Measure the launch configurations of this workspace's shapes and persist them (collective)."""
        return workspace.library_workspace.tune([workspace.hidden_size], dtype=workspace.dtype, cache=path)
