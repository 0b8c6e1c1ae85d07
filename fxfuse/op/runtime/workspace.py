"""Lifecycle of the fused op's workspaces: one per (process group, hidden size, dtype) and kind.

A `WorkspaceRegistry` owns this process's workspaces of one kind (the TensorRT-LLM kernel's, or the
PCIe all-reduce's). The rules, which every rank follows identically:
  1. Creation is explicit (`fxfuse.prepare`, every rank with the same arguments) or happens on the
     first call that needs it, outside CUDA-graph capture; a first call *during* capture raises
     `WorkspaceNotPrepared`, since creation allocates and talks to the peers.
  2. Creation is agreed in two rounds, each one exchange of (failed step, request): first every rank
     loads the kernels (FlashInfer import and JIT) and checks that the memory is free, as local steps
     that never raise; then every rank creates its part (a collective whose own steps are agreed too,
     see `fxfuse.op.runtime.cuda_ipc`). If any rank fails either round, or the ranks asked for different
     workspaces, every rank marks the key failed with the same reason (naming the rank and the step),
     logs once and falls back for good, so no rank is left waiting in a collective the others skipped.
  3. A workspace that a captured CUDA graph may use is never freed behind the graph's back: asking
     for more tokens makes a NEW workspace and keeps the old one alive (retired), a group name that
     comes to mean another group retires its workspaces too, and `destroy(group)` is preceded by
     `check_destroyable`, which refuses while a workspace was used during a capture unless the caller
     says the graphs are gone (`graphs_released=True`).
  4. `destroy` is collective (all ranks of the group call it). At interpreter exit `release_all()`
     never talks to peers (they, or the process group, may be gone): workspaces a capture used are
     left to process teardown (a graph may replay them on any stream); the others are freed once
     every stream that ran a call on them (and the current stream) finished its work within a bounded
     wait (a rank whose peer died mid-kernel would spin forever, and freeing would block behind it);
     if that work does not finish, it says so and leaves the rest to process teardown.
The registry holds no tensor-parallel state beyond this cache, keyed by group name. `TRTLLM`, `PCIE`
and `ONE_KERNEL` (the one-kernel PCIe path's) are this process's registries, `REGISTRIES` all three.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, agreed_failure
from fxfuse.op.runtime.one_kernel_pcie import OneKernelPcieKernels, one_kernel_workspace_bytes
from fxfuse.op.runtime.pcie_kernels import PcieAllReduceKernels, pcie_workspace_bytes
from fxfuse.op.runtime.trtllm_kernels import TrtllmFusionKernels, trtllm_layout

logger = logging.getLogger(__name__)

WorkspaceKey = tuple[str, int, torch.dtype]

#: How long `release_all` waits at exit for this GPU's kernels before giving up on releasing.
EXIT_WAIT_S = 10.0


class WorkspaceNotPrepared(RuntimeError):
    """The first fused call for a (group, hidden size, dtype) came during CUDA-graph capture."""


class WorkspaceKernels(Protocol):
    """What the registry needs from a kernel library (FlashInfer's, or a fake in tests)."""

    def load(self) -> None:
        """Import and build the kernels on this rank; raise if they cannot run here."""

    def destroy_workspace(self, handle: Any, group: dist.ProcessGroup) -> None:
        """Free a workspace (collective over `group`)."""

    def release_workspace(self, handle: Any) -> None:
        """Free what can be freed without talking to peers (at exit)."""


@dataclass
class FusionWorkspace:
    """A ready workspace: the library's handle, its token capacity, whether a capture used it, and
    the CUDA streams its uncaptured calls ran on."""

    key: WorkspaceKey
    max_tokens: int
    handle: Any
    captured: bool = field(default=False)
    streams: set = field(default_factory=set)


class WorkspaceRegistry:
    """This process's workspaces of one kind, by (group name, hidden size, dtype); see the module docstring.

    `kernels_factory` returns the kernel library (called once, lazily). `bytes_needed(world_size,
    max_tokens, hidden_size, dtype)` is the device memory one rank needs for a workspace (checked
    against free memory before creating). `streams_idle(streams, timeout_s)` says whether the given
    CUDA streams (and the current one) finished their work within the timeout (replaced in tests).
    """

    def __init__(
        self,
        name: str,
        kernels_factory: Callable[[], Any],
        bytes_needed: Callable[[int, int, int, torch.dtype], int],
        streams_idle: Callable[[set, float], bool] | None = None,
    ):
        self.name = name
        self._kernels_factory = kernels_factory
        self._kernels: Any = None
        self._bytes_needed = bytes_needed
        self._streams_idle = streams_idle or _cuda_streams_idle
        self._ready: dict[WorkspaceKey, FusionWorkspace] = {}
        self._retired: list[FusionWorkspace] = []
        self._failed: dict[WorkspaceKey, str] = {}
        self._exit_hook_installed = False

    @property
    def kernels(self) -> Any:
        """The kernel library (created on first use)."""
        if self._kernels is None:
            self._kernels = self._kernels_factory()
        return self._kernels

    def lookup(self, group_name: str, hidden_size: int, dtype: torch.dtype) -> FusionWorkspace | None:
        """The ready workspace for this key, or None (absent or failed)."""
        return self._ready.get((group_name, hidden_size, dtype))

    def failure(self, group_name: str, hidden_size: int, dtype: torch.dtype) -> str | None:
        """Why creation failed for this key (agreed by all ranks), or None."""
        return self._failed.get((group_name, hidden_size, dtype))

    def retired(self) -> list[FusionWorkspace]:
        """Replaced workspaces kept alive for the CUDA graphs that may still use them."""
        return list(self._retired)

    def ensure(
        self,
        group: dist.ProcessGroup,
        hidden_size: int,
        dtype: torch.dtype,
        max_tokens: int,
        create: Callable[[Any], Any],
    ) -> FusionWorkspace | None:
        """The workspace for this key holding at least `max_tokens`, created (collectively) if needed.

        `create(kernels)` makes this rank's part (a collective). Returns None, on every rank, if any
        rank could not. Raises WorkspaceNotPrepared when it would have to be created during capture.
        """
        key = (group.group_name, hidden_size, dtype)
        existing = self._ready.get(key)
        if existing is not None and existing.max_tokens >= max_tokens:
            return existing
        if key in self._failed:
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise WorkspaceNotPrepared(
                f"the fused all-reduce + RMSNorm {self.name} workspace for group {group.group_name!r}, hidden size "
                f"{hidden_size}, {dtype} does not exist yet (or is too small) and cannot be created during CUDA-graph "
                f"capture: call fxfuse.prepare(group, hidden_size={hidden_size}, dtype={dtype}, max_tokens=N) on every "
                "rank before capturing (or run one step eagerly first)"
            )
        world_size = dist.get_world_size(group)
        request = (self.name, hidden_size, str(dtype), max_tokens)
        steps = LocalSteps()
        steps.run("loading the kernels (FlashInfer import and JIT)", lambda: self.kernels.load())
        steps.run("checking free GPU memory", self._check_free_memory, world_size, max_tokens, hidden_size, dtype)
        reason = agreed_failure(steps.failure, group, request)
        if reason is not None:
            return self._mark_failed(key, reason)

        steps = LocalSteps()
        handle = steps.run("creating the workspace", create, self.kernels)
        reason = agreed_failure(steps.failure, group, request)
        if reason is not None:
            if handle is not None:  # only some ranks hold a part: free it locally, no collective
                self.kernels.release_workspace(handle)
            return self._mark_failed(key, reason)

        if existing is not None:
            self._retired.append(self._ready.pop(key))
        workspace = FusionWorkspace(key, max_tokens, handle)
        self._ready[key] = workspace
        self._install_exit_hook()
        logger.info("fused all-reduce + RMSNorm %s workspace ready: group %s, hidden %d, %s, %d tokens",
                    self.name, *key, max_tokens)
        return workspace

    def note_use(self, workspace: FusionWorkspace) -> None:
        """Record a call on `workspace`: one during CUDA-graph capture pins it until the graphs are
        released; an uncaptured one records its stream, which exit waits for before freeing."""
        if not torch.cuda.is_available():
            return
        if torch.cuda.is_current_stream_capturing():
            workspace.captured = True
        else:
            workspace.streams.add(torch.cuda.current_stream())

    def group_names(self) -> set[str]:
        """Names of the groups this registry holds workspaces (ready or retired) of."""
        return {w.key[0] for w in self._retired} | {key[0] for key in self._ready}

    def check_destroyable(self, group_name: str, graphs_released: bool) -> None:
        """Raise RuntimeError if a workspace of `group_name` was used while a CUDA graph was captured
        and `graphs_released` is not True: replaying such a graph after a free would write through
        freed memory on this GPU and its peers. Local; `fxfuse.destroy_workspaces` agrees on it first."""
        pinned = [w for w in self._of_group(group_name) if w.captured]
        if pinned and not graphs_released:
            raise RuntimeError(
                f"{len(pinned)} fused all-reduce + RMSNorm {self.name} workspace(s) were used while capturing CUDA "
                "graphs; destroy those graphs first, then call fxfuse.destroy_workspaces(group, graphs_released=True)"
            )

    def destroy(self, group: dist.ProcessGroup) -> None:
        """Free the workspaces of `group`, retired ones too, and forget its failures. Collective; call
        `check_destroyable` (agreed across ranks) first."""
        for workspace in self._of_group(group.group_name):
            self.kernels.destroy_workspace(workspace.handle, group)
        self._drop(group.group_name)

    def forget_group(self, group_name: str) -> None:
        """The name now means another group: retire its ready workspaces (kept alive for graphs that
        captured them, never handed to the new group) and forget its failures. Local."""
        self._retired += [w for key, w in self._ready.items() if key[0] == group_name]
        self._ready = {k: w for k, w in self._ready.items() if k[0] != group_name}
        self._failed = {k: r for k, r in self._failed.items() if k[0] != group_name}

    def _of_group(self, group_name: str) -> list[FusionWorkspace]:
        return [w for w in self._retired if w.key[0] == group_name] + [w for k, w in self._ready.items() if k[0] == group_name]

    def _drop(self, group_name: str) -> None:
        self._retired = [w for w in self._retired if w.key[0] != group_name]
        self._ready = {k: w for k, w in self._ready.items() if k[0] != group_name}
        self._failed = {k: r for k, r in self._failed.items() if k[0] != group_name}

    def release_all(self, wait_s: float = EXIT_WAIT_S) -> None:
        """At exit: free every workspace no capture used, locally, once the streams that used them are
        idle; never talks to peers or hangs."""
        workspaces = self._retired + list(self._ready.values())
        self._ready.clear()
        self._retired.clear()
        releasable = [w for w in workspaces if not w.captured]
        if not releasable:
            return
        streams = set().union(*(w.streams for w in releasable))
        if not self._streams_idle(streams, wait_s):
            print(
                f"fxfuse: the GPU still runs work {wait_s:.0f} s into interpreter exit (a peer rank probably died "
                f"inside a fused all-reduce); leaving {len(releasable)} {self.name} workspace(s) to process teardown",
                file=sys.stderr,
            )
            return
        for workspace in releasable:
            try:
                self.kernels.release_workspace(workspace.handle)
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                logger.debug("releasing workspace %s failed", workspace.key, exc_info=True)

    def _check_free_memory(self, world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Raise MemoryError when this GPU has less free memory than the workspace needs."""
        needed = self._bytes_needed(world_size, max_tokens, hidden_size, dtype)
        free = free_device_memory()
        if free is not None and free < needed:
            raise MemoryError(f"{needed / 2**20:.0f} MiB needed for the workspace, {free / 2**20:.0f} MiB free")

    def _mark_failed(self, key: WorkspaceKey, reason: str) -> None:
        self._failed[key] = reason
        logger.warning(
            "fused all-reduce + RMSNorm %s workspace unavailable for group %s, hidden %d, %s on all ranks (%s); "
            "those calls run NCCL + the fused norm", self.name, *key, reason,
        )
        return None

    def _install_exit_hook(self) -> None:
        if not self._exit_hook_installed:
            atexit.register(self.release_all)
            self._exit_hook_installed = True


def workspace_bytes(world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory one rank allocates for a TensorRT-LLM workspace: the kernel's buffers (one
    two-shot buffer and three Lamport buffers of world_size * tokens * hidden 16-bit elements, plus
    flags, each rounded up to 2 MiB) and the all-zero residual for calls without one."""
    return trtllm_layout(world_size, max_tokens, hidden_size).total_bytes + max_tokens * hidden_size * dtype.itemsize


def free_device_memory() -> int | None:
    """Free bytes on the current GPU (None without CUDA)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def _cuda_streams_idle(streams: set, timeout_s: float) -> bool:
    """True once `streams` and the current stream finished their queued work, False after `timeout_s`
    seconds (polling events: never blocking the host in a synchronize that may never return)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    events = []
    for stream in streams | {torch.cuda.current_stream()}:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    deadline = time.monotonic() + timeout_s
    while not all(event.query() for event in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


#: This process's TensorRT-LLM, PCIe and one-kernel PCIe workspaces.
TRTLLM = WorkspaceRegistry("TensorRT-LLM", TrtllmFusionKernels, workspace_bytes)
PCIE = WorkspaceRegistry("PCIe", PcieAllReduceKernels, pcie_workspace_bytes)
ONE_KERNEL = WorkspaceRegistry("PCIe one-kernel", OneKernelPcieKernels, one_kernel_workspace_bytes)
REGISTRIES = (TRTLLM, PCIE, ONE_KERNEL)
