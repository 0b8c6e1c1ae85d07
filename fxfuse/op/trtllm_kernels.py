"""The one place fxfuse touches FlashInfer: its TensorRT-LLM all-reduce + residual + RMSNorm kernel.

`TrtllmFusionKernels` imports FlashInfer only when `load()` is called (the CUDA path; CPU code
and CPU tests never import this library). It uses FlashInfer's TensorRT-LLM ("trtllm") functions
directly: `trtllm_create_ipc_workspace_for_all_reduce_fusion`, `trtllm_allreduce_fusion` with
pattern kARResidualRMSNorm and fp32 accumulation, and
`trtllm_destroy_ipc_workspace_for_all_reduce_fusion`. They exist with the same keywords from
0.6.3 to 0.7.4. fxfuse never uses the unified `create_allreduce_fusion_workspace`: its backend
"auto" may choose "mnnvl" (NVLink multicast, which must not be used on shared machines), and in
0.6.3 it cannot take a process group.

Version differences handled here: 0.6.3 allocates CUDA-IPC buffers (this works for ranks
sharing one GPU), prints while doing so (sent to the debug log instead), and frees them
collectively. Later versions allocate torch symmetric memory and free it locally.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Oldest FlashInfer release this adapter was written against (newest read: 0.7.4).
MIN_FLASHINFER_VERSION = "0.6.3"


class FlashInferUnavailable(RuntimeError):
    """FlashInfer or its all-reduce fusion kernel cannot be used in this process; says why."""


@dataclass
class TrtllmWorkspace:
    """FlashInfer's workspace for one rank: the IPC pointers, the device pointer table, metadata."""

    ipc_handles: list
    pointer_table: torch.Tensor
    metadata: dict
    rank: int
    world_size: int


def _undeprecated(fn):
    """The function under a `typing_extensions.deprecated` wrapper (whose warning fires per call)."""
    return getattr(fn, "__wrapped__", fn)


class TrtllmFusionKernels:
    """FlashInfer's TensorRT-LLM fusion kernel and its workspace, loaded lazily.

    `load()` raises FlashInferUnavailable once with the reason and remembers it; later calls
    raise the same error without retrying.
    """

    def __init__(self) -> None:
        self._comm: Any = None
        self._error: FlashInferUnavailable | None = None
        self.version = "not loaded"
        self.frees_collectively = False

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
            logger.warning("%s; using the NCCL fallback", self._error)
            raise self._error from exc

    def _import_and_build(self) -> Any:
        if not torch.cuda.is_available():
            raise FlashInferUnavailable("no CUDA device")
        flashinfer = importlib.import_module("flashinfer")
        comm = importlib.import_module("flashinfer.comm")
        trtllm_ar = importlib.import_module("flashinfer.comm.trtllm_ar")
        needed = (
            "trtllm_create_ipc_workspace_for_all_reduce_fusion",
            "trtllm_allreduce_fusion",
            "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
            "AllReduceFusionPattern",
        )
        missing = [name for name in needed if not hasattr(comm, name)]
        if missing:
            raise FlashInferUnavailable(
                f"flashinfer {getattr(flashinfer, '__version__', '?')} lacks {', '.join(missing)} "
                f"(fxfuse supports {MIN_FLASHINFER_VERSION} to 0.7.x)"
            )
        self.version = getattr(flashinfer, "__version__", "unknown")
        # 0.6.3 frees its CUDA-IPC buffers with a barrier; later versions free locally.
        self.frees_collectively = hasattr(trtllm_ar, "free_shared_buffer")
        build = getattr(trtllm_ar, "get_trtllm_comm_module", None)
        if build is not None:
            build()  # JIT-compiles trtllm_comm on first use (about 2 minutes), then loads it
        return comm

    def create_workspace(
        self, group: dist.ProcessGroup, rank: int, world_size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> TrtllmWorkspace:
        """Allocate and exchange this rank's workspace (collective over `group`)."""
        self.load()
        create = _undeprecated(self._comm.trtllm_create_ipc_workspace_for_all_reduce_fusion)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            ipc_handles, pointer_table, metadata = create(
                tp_rank=rank,
                tp_size=world_size,
                max_token_num=max_tokens,
                hidden_dim=hidden_size,
                use_fp32_lamport=dtype == torch.float32,
                group=group,
                create_metadata=True,
            )
        if printed.getvalue():
            logger.debug("flashinfer workspace creation printed:\n%s", printed.getvalue())
        return TrtllmWorkspace(ipc_handles, pointer_table, metadata, rank, world_size)

    def destroy_workspace(self, handle: TrtllmWorkspace, group: dist.ProcessGroup) -> None:
        """Free a workspace; all ranks of `group` must call this together."""
        _undeprecated(self._comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion)(handle.ipc_handles, group)

    def release_workspace(self, handle: TrtllmWorkspace) -> None:
        """Free a workspace without peers where the library allows it; else leave it to process exit."""
        if not self.frees_collectively:
            _undeprecated(self._comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion)(handle.ipc_handles, None)

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
    ) -> None:
        """Launch the fused kernel on [tokens, hidden] contiguous tensors, writing the two outputs.

        residual_out = sum over ranks of x + residual; norm_out = rmsnorm(residual_out) * weight,
        summed in fp32. Safe inside CUDA-graph capture (no allocation, no host sync).
        """
        num_tokens, hidden_size = x.shape
        _undeprecated(self._comm.trtllm_allreduce_fusion)(
            allreduce_in=x,
            world_size=workspace.world_size,
            world_rank=workspace.rank,
            token_num=num_tokens,
            hidden_dim=hidden_size,
            workspace_ptrs=workspace.pointer_table,
            launch_with_pdl=False,
            trigger_completion_at_end=False,
            fp32_acc=True,
            pattern_code=self._comm.AllReduceFusionPattern.kARResidualRMSNorm,
            use_oneshot=oneshot,
            allreduce_out=None,
            residual_in=residual,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=None,
            scale_out=None,
            rms_gamma=weight,
            rms_eps=float(eps),
            scale_factor=None,
            layout_code=None,
            metadata=workspace.metadata,
        )
