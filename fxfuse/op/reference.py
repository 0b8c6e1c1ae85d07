"""The fused op's reference arithmetic and group lookup, shared by every kernel of the op.

`add_rmsnorm` is the rounding order every implementation of `fxfuse::allreduce_residual_rmsnorm`
reproduces (see `fxfuse.op.schema`); `resolve_group` turns the group name a graph carries into the
process group. This module imports no other part of fxfuse, so kernels can use it without
importing the op's registration.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under `group_name` (the name functional collectives carry)."""
    return _resolve_process_group(group_name)


def add_rmsnorm(
    reduced: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add in the input dtype, then RMSNorm in float32 cast back and scaled by `weight`.

    Returns `(normed, residual_out)`; `reduced` is the already all-reduced activation. This is the
    reference arithmetic every kernel of the fused op must reproduce.
    """
    residual_out = reduced if residual is None else reduced + residual
    hidden = residual_out.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normed = (hidden * torch.rsqrt(variance + eps)).to(residual_out.dtype)
    return weight * normed, residual_out
