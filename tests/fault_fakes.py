"""Stand-ins for the CUDA parts of the fused op's first-call path, so that the real agreement code
(group config, workspace registry, shared IPC buffers, plan agreement) runs on CPU tensors over gloo
ranks: a fake GPU (model, arch, NVSwitch links), a fake CUDA runtime for `fxfuse.op.runtime.cuda_ipc`, and a
fake TensorRT-LLM kernel library whose "fused kernel" is a gloo all-reduce plus the reference norm.
Each fake fails where it is told to, on the rank it is told to."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, agreed_failure
from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.runtime.cuda_ipc import SharedBuffer, close_shared_buffers, create_shared_buffers


class FakeRuntime:
    """The CudaRuntime calls, on fake pointers; `fail` maps a call name ("set_device", "malloc", "memset",
    "ipc_handle", "open") to the rank it fails on; records what is live and mapped, and the order of calls."""

    def __init__(self, rank, fail=None):
        self.rank, self.fail = rank, fail or {}
        self.live, self.mapped, self.next = set(), set(), 1000 * (rank + 1)
        self.calls: list[tuple] = []  # (call, pointer or None) in order, of memset, synchronize and ipc_handle

    def _maybe_fail(self, what):
        if self.fail.get(what) == self.rank:
            raise RuntimeError(f"{what} failed on rank {self.rank}")

    def set_device(self, index):
        self._maybe_fail("set_device")

    def malloc(self, size):
        self._maybe_fail("malloc")
        self.next += 16
        self.live.add(self.next)
        return self.next

    def memset(self, pointer, value, size):
        self._maybe_fail("memset")
        self.calls.append(("memset", pointer, value))

    def synchronize(self):
        self.calls.append(("synchronize", None))

    def ipc_handle(self, pointer):
        self._maybe_fail("ipc_handle")
        self.calls.append(("ipc_handle", pointer))
        return pointer.to_bytes(8, "little")

    def ipc_open(self, handle):
        self._maybe_fail("open")
        pointer = int.from_bytes(handle, "little") + 1
        self.mapped.add(pointer)
        return pointer

    def ipc_close(self, pointer):
        self.mapped.remove(pointer)

    def free(self, pointer):
        self.live.remove(pointer)


@dataclass
class FakeWorkspace:
    """What `FakeTrtllmKernels.create_workspace` returns: the shared buffers and the group they span."""

    buffers: list[SharedBuffer]
    runtime: FakeRuntime
    group: dist.ProcessGroup
    zero_residual: torch.Tensor
    freed: bool = field(default=False)

    def zero_residual_for(self, num_tokens: int) -> torch.Tensor:
        return self.zero_residual[:num_tokens]


class FakeTrtllmKernels:
    """The TensorRT-LLM kernel library's interface (`fxfuse.op.runtime.trtllm_kernels.TrtllmFusionKernels`) on
    CPU: the workspace is made of real `create_shared_buffers` over a `FakeRuntime`, its
    initialisation is agreed as the real one is, and the fused kernel is a gloo all-reduce plus the
    reference arithmetic. `fail` names steps ("load", "runtime", "init", or a FakeRuntime call) and
    the rank each fails on."""

    def __init__(self, rank: int, fail: dict[str, int] | None = None):
        self.rank, self.fail = rank, fail or {}
        self.loaded = False
        self.workspaces: list[FakeWorkspace] = []

    def load(self) -> None:
        if self.fail.get("load") == self.rank:
            raise RuntimeError(f"nvcc failed building trtllm_comm on rank {self.rank}")
        self.loaded = True

    def create_workspace(self, group, rank, world_size, max_tokens, hidden_size, dtype) -> FakeWorkspace:
        runtime = None if self.fail.get("runtime") == rank else FakeRuntime(rank, self.fail)
        buffers = create_shared_buffers([64, 64], group, runtime, device_index=0)
        runtime = runtime or FakeRuntime(rank)
        steps = LocalSteps()
        steps.run("initialising the workspace (flags, Lamport buffers, pointer table)", self._initialise)
        failure = agreed_failure(steps.failure, group)
        if failure is not None:
            close_shared_buffers(buffers, group, runtime)
            raise RuntimeError(f"initialising the workspace failed: {failure}")
        workspace = FakeWorkspace(buffers, runtime, group, torch.zeros(max_tokens, hidden_size, dtype=dtype))
        self.workspaces.append(workspace)
        return workspace

    def _initialise(self) -> None:
        if self.fail.get("init") == self.rank:
            raise RuntimeError(f"trtllm_lamport_initialize failed on rank {self.rank}")

    def allreduce_residual_rmsnorm(self, workspace, x, residual, weight, eps, norm_out, residual_out, oneshot,
                                   weight_offset=0.0) -> None:
        summed = x.clone()
        dist.all_reduce(summed, group=workspace.group)
        normed, added = add_rmsnorm(summed, residual, weight, eps, weight_offset, bool(weight_offset))
        norm_out.copy_(normed)
        residual_out.copy_(added)

    def destroy_workspace(self, workspace: FakeWorkspace, group) -> None:
        close_shared_buffers(workspace.buffers, group, workspace.runtime)
        workspace.freed = True

    def release_workspace(self, workspace: FakeWorkspace) -> None:
        close_shared_buffers(workspace.buffers, None, workspace.runtime)
        workspace.freed = True


@contextlib.contextmanager
def patched(*replacements: tuple[Any, str, Any]):
    """Set `obj.name = value` for each (obj, name, value), restoring the old values on exit (the
    spawned ranks' own monkeypatch)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in replacements]
    try:
        for obj, name, value in replacements:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def raising(message: str):
    """A function that raises RuntimeError(message) whatever it is called with."""

    def fail(*args, **kwargs):
        raise RuntimeError(message)

    return fail
