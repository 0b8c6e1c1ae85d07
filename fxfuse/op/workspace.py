"""Lifecycle of the fused kernel's workspaces: one per (process group, hidden size, dtype).

A `WorkspaceRegistry` owns this process's workspaces. Lifecycle of one workspace:
  1. created by `prepare(...)` (explicit; all ranks of the group call it with the same
     arguments) or by the first fused call outside CUDA-graph capture. A first call *during*
     capture raises `WorkspaceNotPrepared`, since creation allocates and talks to the peers;
  2. creation is agreed in two rounds, each one all_reduce of (ok flag, configuration
     fingerprint) over the group: first every rank checks locally that the kernels load, that
     the memory is free, and allocates its zero residual; then every rank creates its part of
     the library's workspace (a collective). If any rank fails either round, or the ranks'
     fingerprints differ, every rank marks the key failed, logs once and falls back for good,
     so no rank is left waiting in a collective the others skipped. (A failure inside the
     library's own exchange, before a rank reaches it, cannot be caught this way: the
     free-memory check of round 1 exists to make that case unlikely);
  3. used by every later call with that key (read-only);
  4. freed by `destroy(group)` (collective: all ranks of the group call it), or at interpreter
     exit by `release_all()`, which never talks to peers (they may have exited already): it
     frees what can be freed locally and leaves the rest to process teardown.
The registry holds no tensor-parallel state beyond this cache, keyed by group name.
"""

from __future__ import annotations

import atexit
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WorkspaceKey = tuple[str, int, torch.dtype]


class WorkspaceNotPrepared(RuntimeError):
    """The first fused call for a (group, hidden size, dtype) came during CUDA-graph capture."""


class FusionKernels(Protocol):
    """What the registry needs from a kernel library (FlashInfer's, or a fake in tests)."""

    def load(self) -> None:
        """Import and build the kernels on this rank; raise if they cannot run here."""

    def create_workspace(
        self, group: dist.ProcessGroup, rank: int, world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> Any:
        """Create this rank's part of the shared workspace (collective over `group`)."""

    def destroy_workspace(self, handle: Any, group: dist.ProcessGroup) -> None:
        """Free a workspace (collective over `group` for some library versions)."""

    def release_workspace(self, handle: Any) -> None:
        """Free what can be freed without talking to peers (used at exit and after failures)."""


@dataclass
class FusionWorkspace:
    """A ready workspace: the library's handle plus an all-zero residual for calls without one."""

    key: WorkspaceKey
    rank: int
    world_size: int
    max_tokens: int
    handle: Any
    zero_residual: torch.Tensor

    def zero_residual_for(self, num_tokens: int) -> torch.Tensor:
        """A [num_tokens, hidden] all-zero residual (adding it leaves the all-reduced sum unchanged)."""
        return self.zero_residual[:num_tokens]


def workspace_bytes(world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory one rank needs for a workspace: the kernel's buffers plus the zero residual.

    FlashInfer allocates a two-shot buffer and three Lamport buffers of world_size * max_tokens *
    hidden 16-bit elements each, plus small flag buffers (each rounded up to 2 MiB in 0.6.x).
    """
    kernel_buffers = 4 * world_size * max_tokens * hidden_size * 2 + 3 * (2 << 20)
    return kernel_buffers + max_tokens * hidden_size * dtype.itemsize


def fingerprint(*values: Any) -> int:
    """A 31-bit checksum of `values`' reprs, compared across ranks to detect disagreeing configs."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small tensor must live for a collective on `group` (CPU for gloo, else the GPU)."""
    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_ranks_agree(ok: bool, config_fingerprint: int, group: dist.ProcessGroup) -> bool:
    """True on every rank iff every rank passed `ok` and the same fingerprint (one all_reduce)."""
    flags = torch.tensor([int(ok), config_fingerprint, -config_fingerprint], dtype=torch.int64)
    flags = flags.to(collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    all_ok, lowest, minus_highest = flags.tolist()
    return all_ok == 1 and lowest == -minus_highest


class WorkspaceRegistry:
    """This process's workspaces by (group name, hidden size, dtype); see the module docstring.

    `kernels_factory` returns the kernel library (called once, lazily, on first creation).
    `config_fingerprint(group, hidden_size, dtype, max_tokens)` returns a checksum of everything
    the fused-or-not decision depends on (settings, thresholds, GPU); ranks must agree on it.
    """

    def __init__(
        self,
        kernels_factory: Callable[[], FusionKernels],
        config_fingerprint: Callable[[dist.ProcessGroup, int, torch.dtype, int], int] = lambda *a: 0,
        device_for_buffers: Callable[[], torch.device] = lambda: torch.device("cuda", torch.cuda.current_device()),
    ):
        self._kernels_factory = kernels_factory
        self._kernels: FusionKernels | None = None
        self._config_fingerprint = config_fingerprint
        self._device_for_buffers = device_for_buffers
        self._ready: dict[WorkspaceKey, FusionWorkspace] = {}
        self._failed: dict[WorkspaceKey, str] = {}
        self._exit_hook_installed = False

    def lookup(self, group_name: str, hidden_size: int, dtype: torch.dtype) -> FusionWorkspace | None:
        """The ready workspace for this key, or None (absent or failed)."""
        return self._ready.get((group_name, hidden_size, dtype))

    def failure(self, group_name: str, hidden_size: int, dtype: torch.dtype) -> str | None:
        """Why creation failed for this key (agreed by all ranks), or None."""
        return self._failed.get((group_name, hidden_size, dtype))

    def for_call(self, group_name: str, hidden_size: int, dtype: torch.dtype, max_tokens: int) -> FusionWorkspace | None:
        """The workspace a fused call uses, created on first use; None if creation failed.

        Raises WorkspaceNotPrepared when it would have to be created during CUDA-graph capture.
        """
        key = (group_name, hidden_size, dtype)
        if key in self._ready:
            return self._ready[key]
        if key in self._failed:
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise WorkspaceNotPrepared(
                f"the fused all-reduce + RMSNorm workspace for group {group_name!r}, hidden size {hidden_size}, "
                f"{dtype} does not exist yet and cannot be created during CUDA-graph capture: call "
                f"fxfuse.prepare(group, hidden_size={hidden_size}, dtype={dtype}, max_tokens=N) on every rank "
                "before capturing (or run one step eagerly first)"
            )
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return self.prepare(group, hidden_size, dtype, max_tokens)

    def prepare(self, group: dist.ProcessGroup, hidden_size: int, dtype: torch.dtype, max_tokens: int) -> FusionWorkspace | None:
        """Create (collectively) the workspace for this key; None if any rank could not.

        Keeps an existing workspace that already holds `max_tokens`; replaces a smaller one.
        """
        key = (group.group_name, hidden_size, dtype)
        existing = self._ready.get(key)
        if existing is not None and existing.max_tokens >= max_tokens:
            return existing
        if existing is not None:
            self._destroy_one(existing, group)
        self._failed.pop(key, None)
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        config = self._config_fingerprint(group, hidden_size, dtype, max_tokens)

        kernels, zero_residual, local_error = self._prepare_here(world_size, max_tokens, hidden_size, dtype)
        if not all_ranks_agree(local_error is None, config, group):
            return self._mark_failed(key, local_error or "another rank could not load the kernels, or settings differ")

        handle, local_error = None, None
        try:
            handle = kernels.create_workspace(group, rank, world_size, max_tokens, hidden_size, dtype)
        except Exception as exc:  # noqa: BLE001 - any failure must become an agreed fallback, not a hang
            local_error = f"workspace creation failed: {type(exc).__name__}: {exc}"
        if not all_ranks_agree(local_error is None, config, group):
            if handle is not None:
                kernels.release_workspace(handle)
            return self._mark_failed(key, local_error or "workspace creation failed on another rank")

        workspace = FusionWorkspace(key, rank, world_size, max_tokens, handle, zero_residual)
        self._ready[key] = workspace
        self._install_exit_hook()
        logger.info("fused all-reduce + RMSNorm workspace ready: group %s, hidden %d, %s, %d tokens", *key, max_tokens)
        return workspace

    def destroy(self, group: dist.ProcessGroup | None = None) -> None:
        """Free the workspaces of `group` (all groups if None) and forget failures; collective."""
        for key, workspace in list(self._ready.items()):
            if group is None or key[0] == group.group_name:
                self._destroy_one(workspace, group or dist.distributed_c10d._resolve_process_group(key[0]))
        for key in list(self._failed):
            if group is None or key[0] == group.group_name:
                del self._failed[key]

    def release_all(self) -> None:
        """Drop every workspace without talking to peers (at exit, when peers may be gone)."""
        for workspace in self._ready.values():
            try:
                self._kernels.release_workspace(workspace.handle)
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                logger.debug("releasing workspace %s failed", workspace.key, exc_info=True)
        self._ready.clear()

    def _prepare_here(self, world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype):
        """Round 1, local part: load kernels, check free memory, allocate the zero residual.

        Returns (kernels, zero_residual, error); error is None on success.
        """
        try:
            if self._kernels is None:
                self._kernels = self._kernels_factory()
            self._kernels.load()
            device = self._device_for_buffers()
            if device.type == "cuda":
                needed = workspace_bytes(world_size, max_tokens, hidden_size, dtype)
                free, _ = torch.cuda.mem_get_info(device)
                if free < needed:
                    error = f"{needed / 2**20:.0f} MiB needed for the workspace, {free / 2**20:.0f} MiB free"
                    return self._kernels, None, error
            zero_residual = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
            return self._kernels, zero_residual, None
        except Exception as exc:  # noqa: BLE001 - reported through the agreement round
            return self._kernels, None, f"{type(exc).__name__}: {exc}"

    def _destroy_one(self, workspace: FusionWorkspace, group: dist.ProcessGroup) -> None:
        del self._ready[workspace.key]
        self._kernels.destroy_workspace(workspace.handle, group)

    def _mark_failed(self, key: WorkspaceKey, reason: str) -> None:
        self._failed[key] = reason
        logger.warning(
            "fused all-reduce + RMSNorm disabled for group %s, hidden %d, %s on all ranks (%s); "
            "using the NCCL fallback", *key, reason,
        )
        return None

    def _install_exit_hook(self) -> None:
        if not self._exit_hook_installed:
            atexit.register(self.release_all)
            self._exit_hook_installed = True
