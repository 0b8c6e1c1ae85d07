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


#: The schema of the arguments that say how the weight is applied (`add_rmsnorm`), shared by every fused op.
NORM_ARGUMENTS = "float weight_offset=0., bool weight_in_fp32=False"


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


def check_arguments(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, weight_in_fp32: bool = False) -> None:
    """Raise ValueError unless x is [..., hidden]; residual (if any) has x's shape and device and x's
    dtype, or float32 (a float32 residual stream); weight is a [hidden] vector on x's device of x's dtype,
    or float32 when it is applied in float32: what every kernel of the op assumes."""
    problems = []
    if x.dim() < 1:
        problems.append(f"x must have a hidden dimension, got shape {list(x.shape)}")
    elif weight.shape != x.shape[-1:]:
        problems.append(f"weight {list(weight.shape)} must be [hidden] = {list(x.shape[-1:])}")
    if residual is not None and residual.shape != x.shape:
        problems.append(f"residual {list(residual.shape)} must have x's shape {list(x.shape)}")
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        problems.append(f"residual dtype {residual.dtype} must be x's {x.dtype} or float32")
    elif residual is not None and residual.dtype != x.dtype and not weight_in_fp32:
        problems.append(f"a float32 residual with {x.dtype} x needs the weight applied in float32 (weight_in_fp32)")
    if weight.dtype != x.dtype and not (weight_in_fp32 and weight.dtype == torch.float32):
        problems.append(f"weight dtype {weight.dtype} must be x's {x.dtype}" + (" or float32" if weight_in_fp32 else ""))
    for name, t in (("residual", residual), ("weight", weight)):
        if t is not None and t.device != x.device:
            problems.append(f"{name} is on {t.device}, x on {x.device}")
    if problems:
        raise ValueError("allreduce_residual_rmsnorm: " + "; ".join(problems))


def add_rmsnorm(
    reduced: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    weight_offset: float = 0.0, weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then RMSNorm in float32, scaled by the weight, in `reduced`'s dtype.

    Returns `(normed, residual_out)`; `reduced` is the already all-reduced activation. The add is in
    the residual's dtype (`reduced` converted to it first: a float32 residual stream keeps a float32
    `residual_out`). The weight is applied as transformers' LlamaRMSNorm does (the norm cast back to the
    dtype, then times the weight in it), or, with `weight_in_fp32`, in float32 before the one cast back
    (`F.rms_norm`; Gemma's `* (1 + weight.float())` with `weight_offset` 1.0). This is the reference
    arithmetic every kernel of the fused op must reproduce.
    """
    residual_out = reduced if residual is None else reduced.to(residual.dtype) + residual
    hidden = residual_out.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normalized = hidden * torch.rsqrt(variance + eps)
    if weight_in_fp32:
        scale = weight.float() + weight_offset if weight_offset else weight.float()
        return (normalized * scale).to(reduced.dtype), residual_out
    return weight * normalized.to(residual_out.dtype), residual_out
