"""The one-kernel PCIe path's workspaces and launches: `fxfuse.op.kernels.one_shot_all_reduce_norm` over
the project's own CUDA IPC buffers.

A workspace holds, on each rank, one receive buffer of 3 generations x world_size x `max_tokens` rows x
hidden 16-bit elements (`receive_buffer_bytes`), made and mapped by every rank together
(`fxfuse.op.runtime.cuda_ipc.create_shared_buffers`, each buffer set to the protocol's empty value before
any peer can map it), every rank's buffer as this process maps it (a pointer argument of the kernel each), and
this rank's generation flags, in device memory. Its lifecycle is `fxfuse.op.runtime.workspace`'s (agreed creation, never freed under a
captured graph, collective destroy, local release at exit). One workspace serves one stream at a time
(`fxfuse.op.runtime.stream_order`).

Why these choices (docs/FUSED_OP.md has the longer form):
- the project's CUDA IPC buffers rather than torch symmetric memory: they work on torch 2.11-2.15 alike
  and for ranks sharing one GPU (how the tests run), and creation failures are agreed step by step;
- Triton: the epilogue is then the very code the two-kernel path runs (`add_rmsnorm_tile`, `quantize_tile`),
  so every norm variant and FP8 recipe comes with it, and no compiler beyond torch's own is needed;
- Lamport sentinels with three generations: no flag round trip across PCIe before the data (the data is the
  flag), and a generation counter that only takes the values 0-2 in device memory (no wrap-around, any
  number of CUDA-graph replays).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxfuse.op.decide.policy import ONE_KERNEL_MAX_HIDDEN
from fxfuse.op.kernels.one_shot_all_reduce_norm import (
    FLAG_WORDS, DeviceAddress, Epilogue, PeerBuffers, all_reduce_norm_into, receive_buffer_bytes,
)
from fxfuse.op.runtime.cuda_ipc import SharedBuffer, close_shared_buffers, create_shared_buffers
from fxfuse.op.runtime.stream_order import bind_to_current_stream

#: The receive buffers' empty value, byte by byte (0xFFFF per 16-bit element: see one_shot_triton.SENTINEL).
EMPTY_BYTE = 0xFF
#: Most rows a one-kernel workspace holds: above this the one-shot exchange (every rank reads every rank's
#: rows) loses to the two-kernel path's two-shot all-reduce on any PCIe machine's bandwidth; a tuning file
#: decides below it.
ONE_KERNEL_MAX_TOKENS = 256


def one_kernel_workspace_bytes(world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory one rank allocates for a one-kernel workspace: its receive buffer, plus slack for its flags
    and the allocator's rounding."""
    return receive_buffer_bytes(world_size, max_tokens, hidden_size) + (1 << 20)


@dataclass
class OneKernelWorkspace:
    """This rank's part of a one-kernel workspace and the stream it is bound to."""

    peers: PeerBuffers
    shared: SharedBuffer
    stream: torch.cuda.Stream | None = field(default=None)


class OneKernelPcieKernels:
    """Makes one-kernel workspaces and runs the kernel on them (the registry's kernel library)."""

    def load(self) -> None:
        """Check that Triton is importable (the kernel compiles on its first call, in the plan's agreement)."""
        importlib.import_module("triton")

    def create_workspace(self, group: dist.ProcessGroup, max_tokens: int, hidden_size: int) -> OneKernelWorkspace:
        """Make and map every rank's receive buffer for up to `max_tokens` rows of `hidden_size` (collective)."""
        if hidden_size > ONE_KERNEL_MAX_HIDDEN:
            raise ValueError(f"hidden size {hidden_size} is wider than the one-kernel path's {ONE_KERNEL_MAX_HIDDEN}")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        [shared] = create_shared_buffers([receive_buffer_bytes(world_size, max_tokens, hidden_size)], group,
                                         initial_byte=EMPTY_BYTE)
        try:
            flags = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=torch.device("cuda", torch.cuda.current_device()))
        except Exception:
            close_shared_buffers([shared], None)
            raise
        buffers = tuple(DeviceAddress(pointer) for pointer in shared.pointers)
        return OneKernelWorkspace(PeerBuffers(buffers, flags, rank, max_tokens, hidden_size), shared)

    def run(self, workspace: OneKernelWorkspace, x: torch.Tensor, epilogue: Epilogue, **outputs) -> None:
        """One launch on contiguous [tokens, hidden] `x`, ordered after the workspace's previous stream's
        calls (`all_reduce_norm_into`'s keyword arguments in `outputs`)."""
        bind_to_current_stream(workspace)
        all_reduce_norm_into(workspace.peers, x, epilogue, **outputs)

    def destroy_workspace(self, workspace: OneKernelWorkspace, group: dist.ProcessGroup) -> None:
        """Unmap the peers' buffers, wait for every rank, free this rank's (collective)."""
        close_shared_buffers([workspace.shared], group)

    def release_workspace(self, workspace: OneKernelWorkspace) -> None:
        """Unmap and free locally (at exit, or after a creation some rank failed)."""
        close_shared_buffers([workspace.shared], None)
