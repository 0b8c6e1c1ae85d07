"""The fused op's reference arithmetic and group lookup, shared by every kernel of the op.

`add_rmsnorm` is the rounding order every implementation of `fxfuse::allreduce_residual_rmsnorm`
reproduces (see `fxfuse.op.schema`); `resolve_group` turns the group name a graph carries into the
process group; `may_overlap` says whether two tensors can share memory, which decides whether a
donated input may be all-reduced in place. This module imports no other part of fxfuse, so kernels can use it without
importing the op's registration.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under `group_name` (the name functional collectives carry)."""
    return _resolve_process_group(group_name)


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses [first, end) that `t`'s elements occupy ((0, 0) for an empty tensor)."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def may_overlap(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the memory spans of `a` and `b` intersect (False when `b` is None): writing `a` may
    then change what `b` reads."""
    if b is None:
        return False
    a_start, a_end = memory_span(a)
    b_start, b_end = memory_span(b)
    return a_start < b_end and b_start < a_end


def writable_in_place(x: torch.Tensor, x_donated: bool, *read_after: torch.Tensor | None) -> bool:
    """Whether a kernel may all-reduce in `x`'s own memory: the caller donated it, it is contiguous,
    and no tensor the kernel reads afterwards (residual, weight) shares its memory."""
    return x_donated and x.is_contiguous() and not any(may_overlap(x, t) for t in read_after)


def check_arguments(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """Raise ValueError unless x is [..., hidden], residual (if any) has x's shape, dtype and device,
    and weight is a [hidden] vector of x's dtype on x's device: what every kernel of the op assumes."""
    problems = []
    if x.dim() < 1:
        problems.append(f"x must have a hidden dimension, got shape {list(x.shape)}")
    elif weight.shape != x.shape[-1:]:
        problems.append(f"weight {list(weight.shape)} must be [hidden] = {list(x.shape[-1:])}")
    if residual is not None and residual.shape != x.shape:
        problems.append(f"residual {list(residual.shape)} must have x's shape {list(x.shape)}")
    for name, t in (("residual", residual), ("weight", weight)):
        if t is not None and t.dtype != x.dtype:
            problems.append(f"{name} dtype {t.dtype} must be x's {x.dtype}")
        if t is not None and t.device != x.device:
            problems.append(f"{name} is on {t.device}, x on {x.device}")
    if problems:
        raise ValueError("allreduce_residual_rmsnorm: " + "; ".join(problems))


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
