"""FlashInfer's TensorRT-LLM all-reduce + residual + RMSNorm kernel, on a workspace fxfuse builds itself.

`TrtllmFusionKernels` imports FlashInfer only in `load()` (the CUDA path; CPU code never imports
it) and launches `flashinfer.comm.trtllm_allreduce_fusion` with pattern kARResidualRMSNorm and fp32 accumulation,
never the unified API (its backend "auto" may pick "mnnvl", NVLink multicast, which
must not run on shared machines).

The workspace is built here, in the layout FlashInfer's `trtllm_create_ipc_workspace_for_all_reduce_fusion`
documents (0.6.3 to 0.7.x), from `fxfuse.op.runtime.cuda_ipc` shared buffers rather than by that function:
- FlashInfer 0.6.3 leaves the two-shot barrier flags uninitialised (stale flags in reused memory can
  let the first barrier pass early), never frees its 20-byte flag buffer nor unmaps its peers' buffers,
  and can leave peers waiting in a barrier when mapping fails on one rank;
- 0.7.x allocates through torch symmetric memory, which refuses ranks that share a GPU.
Built here, every allocation is agreed, zeroed and released, on every version and for shared GPUs.
Layout, per rank: a two-shot buffer of world_size * tokens * hidden 16-bit elements, world_size * 256
int32 barrier flags (zeroed), three Lamport buffers of `lamport_comm_bytes` each (filled by FlashInfer's
`trtllm_lamport_initialize`), and a local int32[5] state {0, 0, 0, lamport_comm_bytes, 0}. The kernel
reads one device table of pointers: every rank's two-shot buffer, every rank's flags, every rank's
Lamport buffer, then the state.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, agreed_failure
from fxfuse.op.decide.policy import MAX_LAMPORT_COMM_BYTES
from fxfuse.op.runtime.cuda_ipc import SharedBuffer, close_shared_buffers, create_shared_buffers


#: Barrier flags per rank in the kernel's two-shot protocol (FlashInfer's BarrierFlagCount).
BARRIER_FLAGS_PER_RANK = 256
#: Buffers are rounded up to 2 MiB, as FlashInfer 0.6.x does.
BUFFER_ALIGNMENT = 1 << 21
#: FlashInfer functions this adapter calls.
NEEDED_API = ("trtllm_allreduce_fusion", "AllReduceFusionPattern")


class FlashInferUnavailable(RuntimeError):
    """FlashInfer or its all-reduce fusion kernel cannot be used in this process; says why."""


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TrtllmLayout:
    """Byte sizes of one rank's workspace buffers for (world size, tokens, hidden)."""

    two_shot_bytes: int
    flag_bytes: int
    lamport_comm_bytes: int

    @property
    def lamport_bytes(self) -> int:
        """The three Lamport buffers together."""
        return 3 * self.lamport_comm_bytes

    @property
    def total_bytes(self) -> int:
        """Device memory one rank allocates for the kernel (rounded as allocated)."""
        return sum(_round_up(size, BUFFER_ALIGNMENT) for size in (self.two_shot_bytes, self.flag_bytes, self.lamport_bytes))


def trtllm_layout(world_size: int, max_tokens: int, hidden_size: int) -> TrtllmLayout:
    """The workspace layout for 16-bit activations; raises ValueError above the 32-bit offset limit."""
    comm = world_size * max_tokens * hidden_size * 2
    if comm > MAX_LAMPORT_COMM_BYTES:
        raise ValueError(
            f"a TensorRT-LLM workspace of {max_tokens} tokens x hidden {hidden_size} at world size {world_size} needs a "
            f"{comm / 2**30:.2f} GiB Lamport exchange; the kernel's 32-bit offsets allow less than 1 GiB"
        )
    return TrtllmLayout(two_shot_bytes=comm, flag_bytes=world_size * BARRIER_FLAGS_PER_RANK * 4, lamport_comm_bytes=comm)


@dataclass
class TrtllmWorkspace:
    """One rank's part of a workspace: the shared buffers, the kernel's state and its pointer table."""

    rank: int
    world_size: int
    layout: TrtllmLayout
    buffers: list[SharedBuffer]
    state: torch.Tensor
    pointer_table: torch.Tensor
    zero_residual: torch.Tensor

    def zero_residual_for(self, num_tokens: int) -> torch.Tensor:
        """A [num_tokens, hidden] all-zero residual (adding it leaves the all-reduced sum unchanged)."""
        return self.zero_residual[:num_tokens]


class TrtllmFusionKernels:
    """FlashInfer's TensorRT-LLM fusion kernel and its workspace, loaded lazily.

    `load()` raises FlashInferUnavailable once with the reason and remembers it; later calls raise
    the same error without retrying.
    """

    def __init__(self) -> None:
        self._comm: Any = None
        self._error: FlashInferUnavailable | None = None

    def load(self) -> None:
        """Import FlashInfer, check its API, and build (JIT, minutes the first time) the kernel."""
        if self._comm is not None:
            return
        if self._error is not None:
            raise self._error
        try:
            self._comm = self._import_and_build()
        except Exception as exc:  # noqa: BLE001 - any import/JIT failure means: fall back
            self._error = FlashInferUnavailable(f"FlashInfer all-reduce fusion unavailable: {type(exc).__name__}: {exc}")
            raise self._error from exc

    @staticmethod
    def _import_and_build() -> Any:
        if not torch.cuda.is_available():
            raise FlashInferUnavailable("no CUDA device")
        comm = importlib.import_module("flashinfer.comm")
        trtllm_ar = importlib.import_module("flashinfer.comm.trtllm_ar")
        missing = [name for name in NEEDED_API if not hasattr(comm, name)]
        if not hasattr(trtllm_ar, "trtllm_lamport_initialize"):
            missing.append("trtllm_ar.trtllm_lamport_initialize")
        if missing:
            raise FlashInferUnavailable(f"this flashinfer lacks {', '.join(missing)}")
        trtllm_ar.get_trtllm_comm_module()  # JIT-compiles trtllm_comm on first use (about 2 minutes), then loads it
        return comm

    def create_workspace(
        self, group: dist.ProcessGroup, rank: int, world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> TrtllmWorkspace:
        """Allocate, share and initialise this rank's workspace for `dtype` activations (collective over `group`)."""
        self.load()
        layout = trtllm_layout(world_size, max_tokens, hidden_size)
        sizes = [_round_up(s, BUFFER_ALIGNMENT) for s in (layout.two_shot_bytes, layout.flag_bytes, layout.lamport_bytes)]
        buffers = create_shared_buffers(sizes, group)
        two_shot, flags, lamport = buffers
        steps = LocalSteps()
        parts = steps.run("initialising the workspace (flags, Lamport buffers, pointer table)", self._initialise,
                          layout, two_shot, flags, lamport, max_tokens, hidden_size, dtype)
        failure = agreed_failure(steps.failure, group)
        if failure is not None:  # no peer writes into buffers a rank has not initialised
            close_shared_buffers(buffers, group)
            raise FlashInferUnavailable(f"initialising the workspace failed: {failure}")
        return TrtllmWorkspace(rank, world_size, layout, buffers, *parts)

    @staticmethod
    def _initialise(layout: TrtllmLayout, two_shot: SharedBuffer, flags: SharedBuffer, lamport: SharedBuffer,
                    max_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero the barrier flags, fill the Lamport buffers, and make the kernel's state, pointer table and
        all-zero residual on this rank's GPU; returns (state, pointer table, zero residual)."""
        device = torch.device("cuda", torch.cuda.current_device())
        _device_view(flags.local, flags.size, device).zero_()
        lamport_init = importlib.import_module("flashinfer.comm.trtllm_ar").trtllm_lamport_initialize
        lamport_init(lamport.local, lamport.size // 2, torch.float16)
        state = torch.tensor([0, 0, 0, layout.lamport_comm_bytes, 0], dtype=torch.int32, device=device)
        table = [*two_shot.pointers, *flags.pointers, *lamport.pointers, state.data_ptr()]
        pointer_table = torch.tensor(table, dtype=torch.int64, device=device)
        zero_residual = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        torch.cuda.synchronize(device)
        return state, pointer_table, zero_residual

    def destroy_workspace(self, handle: TrtllmWorkspace, group: dist.ProcessGroup) -> None:
        """Free a workspace; all ranks of `group` must call this together (after their kernels finished)."""
        torch.cuda.synchronize()
        close_shared_buffers(handle.buffers, group)

    def release_workspace(self, handle: TrtllmWorkspace) -> None:
        """Unmap and free this rank's buffers without talking to peers (at exit, or after a failure)."""
        close_shared_buffers(handle.buffers, None)

    def allreduce_residual_rmsnorm(
        self,
        workspace: TrtllmWorkspace,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        norm_out: torch.Tensor,
        residual_out: torch.Tensor,
        oneshot: bool,
        weight_offset: float = 0.0,
    ) -> None:
        """Launch the fused kernel on [tokens, hidden] contiguous, 16-byte aligned tensors.

        residual_out = sum over ranks of x + residual; norm_out = rmsnorm(residual_out) * weight,
        summed in fp32. A `weight_offset` is added to the weight in float32 (FlashInfer's
        `weight_bias`, from 0.7.2; the policy picks this kernel for such sites only there). Safe inside
        CUDA-graph capture (no allocation, no host sync).
        """
        self._launch(workspace, x, self._comm.AllReduceFusionPattern.kARResidualRMSNorm, oneshot, residual_in=residual,
                     residual_out=residual_out, norm_out=norm_out, rms_gamma=weight, rms_eps=float(eps),
                     **({"weight_bias": float(weight_offset)} if weight_offset else {}))

    def all_reduce(self, workspace: TrtllmWorkspace, x: torch.Tensor, out: torch.Tensor, oneshot: bool) -> None:
        """Launch the kernel's all-reduce alone (pattern kAllReduce) on [tokens, hidden] contiguous, 16-byte
        aligned tensors: out = sum over ranks of x, summed in fp32 (`out` may be `x`). Safe inside CUDA-graph
        capture."""
        self._launch(workspace, x, self._comm.AllReduceFusionPattern.kAllReduce, oneshot, allreduce_out=out)

    def _launch(self, workspace: TrtllmWorkspace, x: torch.Tensor, pattern, oneshot: bool, **tensors) -> None:
        """`trtllm_allreduce_fusion` on the workspace with fp32 accumulation, no PDL, `pattern`, and the
        pattern's own arguments in `tensors` (every other output or input None)."""
        num_tokens, hidden_size = x.shape
        fusion = getattr(self._comm.trtllm_allreduce_fusion, "__wrapped__", self._comm.trtllm_allreduce_fusion)
        arguments = dict(allreduce_out=None, residual_in=None, residual_out=None, norm_out=None, quant_out=None,
                         scale_out=None, rms_gamma=None, rms_eps=None, scale_factor=None, layout_code=None)
        fusion(allreduce_in=x, world_size=workspace.world_size, world_rank=workspace.rank, token_num=num_tokens,
               hidden_dim=hidden_size, workspace_ptrs=workspace.pointer_table, launch_with_pdl=False,
               trigger_completion_at_end=False, fp32_acc=True, pattern_code=pattern, use_oneshot=oneshot,
               **{**arguments, **tensors})


class _DeviceArray:
    """A `__cuda_array_interface__` view of raw device memory, for torch.as_tensor (no copy)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "strides": None,
                                         "version": 3}


def _device_view(pointer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of raw device memory at `pointer` (it does not own the memory)."""
    return torch.as_tensor(_DeviceArray(pointer, nbytes), device=device)
