"""The fused ops' CPU kernel: the reference every implementation reproduces, over gloo.

`allreduce_residual_rmsnorm_cpu` runs the group's agreement on its first call (so a bad FXFUSE_*
setting on any rank is the same error on every rank, on CPU as on CUDA), a gloo all-reduce (in x
itself when donated, contiguous and sharing no memory with the residual or weight), then the
reference arithmetic `fxfuse.op.reference.add_rmsnorm`. Both the plain op (`fxfuse.op.schema`) and
its FP8 variant (`fxfuse.op.fp8_schema`) register it; `all_reduce_cpu` and `all_reduce_in_place_cpu`
are the all-reduce-only ops' (`fxfuse.op.all_reduce_schema`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.op.decide.group_config import agreed_config
from fxfuse.op.reference import add_rmsnorm, check_arguments, resolve_group, writable_in_place


def allreduce_residual_rmsnorm_cpu(x, residual, weight, eps, group_name: str, x_donated: bool, weight_offset: float = 0.0,
                                   weight_in_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) of the op on CPU tensors; outputs never alias an input."""
    check_arguments(x, residual, weight, weight_in_fp32)
    group = resolve_group(group_name)
    agreed_config(group, x.device)
    in_place = writable_in_place(x, x_donated, residual, weight)
    reduced = x if in_place else x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    normed, residual_out = add_rmsnorm(reduced, residual, weight, float(eps), weight_offset, weight_in_fp32)
    return normed, residual_out.clone() if residual_out is x else residual_out


def all_reduce_cpu(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """CPU kernel of `fxfuse::all_reduce`: the group's agreement on its first call, then a gloo all-reduce
    of a contiguous copy."""
    reduced = x.clone(memory_format=torch.contiguous_format)
    all_reduce_in_place_cpu(reduced, group_name)
    return reduced


def all_reduce_in_place_cpu(x: torch.Tensor, group_name: str) -> None:
    """CPU kernel of `fxfuse::all_reduce_`: the group's agreement on its first call, then a gloo all-reduce
    in `x` (through a contiguous copy if x is not contiguous)."""
    group = resolve_group(group_name)
    agreed_config(group, x.device)
    target = x if x.is_contiguous() else x.contiguous()
    dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
    if target is not x:
        x.copy_(target)
