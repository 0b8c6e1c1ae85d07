"""CUDA kernel of `fxfuse::allreduce_residual_rmsnorm`: FlashInfer when it takes the call, else NCCL.

The hook: if a module `fxfuse.op.fused_path` exists (written in the FlashInfer issue), its
`try_allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)` is asked first. It returns
`(normed, residual_out)` with the semantics documented in `fxfuse.op.schema`, or None to decline (GPU or
shape it does not handle, policy says unfused); that decision must be the same on every rank.
Otherwise the fallback runs: an NCCL all-reduce over the named group on a copy of `x`, then the
add + RMSNorm reference arithmetic (`fxfuse.op.schema.add_rmsnorm`) as eager CUDA kernels.

Importing this module never imports FlashInfer or touches CUDA, so it is safe on CPU-only machines.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import torch.distributed as dist

from fxfuse.op.reference import add_rmsnorm, resolve_group

FLASHINFER_HOOK_MODULE = "fxfuse.op.fused_path"


@functools.cache
def flashinfer_hook() -> ModuleType | None:
    """The optional `fxfuse.op.fused_path` module, or None when it is not installed."""
    try:
        return importlib.import_module(FLASHINFER_HOOK_MODULE)
    except ModuleNotFoundError as err:
        if err.name != FLASHINFER_HOOK_MODULE:
            raise
        return None


def allreduce_residual_rmsnorm_cuda(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused all-reduce + residual add + RMSNorm on CUDA tensors: FlashInfer if it accepts, else NCCL."""
    hook = flashinfer_hook()
    if hook is not None:
        fused = hook.try_allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)
        if fused is not None:
            return fused
    reduced = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=resolve_group(group_name))
    return add_rmsnorm(reduced, residual, weight, eps)
