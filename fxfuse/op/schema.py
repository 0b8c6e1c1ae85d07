"""The fused collective+norm op: `torch.ops.fxfuse.allreduce_residual_rmsnorm`.

Schema (fixed by docs/ARCHITECTURE.md):
`allreduce_residual_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name)
-> (Tensor normed, Tensor residual_out)`.

Semantics, with `dtype = x.dtype` (residual and weight have that dtype too; the passes only fuse
such sites):
- `reduced = all_reduce_sum(x)` over the process group named `group_name`, in `dtype`;
- `residual_out = reduced + residual` rounded to `dtype` (just `reduced` when residual is None);
- `normed = weight * (h * rsqrt(mean(h**2, -1) + eps)).to(dtype)` with `h = residual_out` in
  float32: the norm runs in float32, is cast back to `dtype`, THEN multiplied by the weight in
  `dtype` (the Hugging Face transformers order, which the reference model uses). Where the matched
  model applied the weight in float32 before casting back (`F.rms_norm`), the fused result can differ
  from the unfused one by one rounding step of `dtype`; in float32 both orders are the same.

Overload `tensor_eps` takes `eps` as a 0-dim tensor (read with `float(eps)` when the kernel runs):
under `torch.compile(dynamic=True)` dynamo turns Python float attributes such as a norm's eps into
float64 scalar tensor inputs of the graph, and the fusion pass then passes that tensor along, so the
compiled graph still honours a changed eps without a recompile. The pass uses it only for CPU
scalars, so reading one never synchronizes a GPU.

The CPU kernel (gloo) is the reference (its arithmetic is `fxfuse.op.reference.add_rmsnorm`). The CUDA
kernel lives in `fxfuse.op.cuda_dispatch`, which is imported only when a CUDA tensor reaches the op. The fake kernel makes the op traceable with
symbolic token counts. Both outputs are fresh tensors: they never alias an input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.op.reference import add_rmsnorm, resolve_group

OP_NAME = "fxfuse::allreduce_residual_rmsnorm"
TENSOR_EPS_OP_NAME = f"{OP_NAME}.tensor_eps"

torch.library.define(
    OP_NAME,
    "(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name) -> (Tensor normed, Tensor residual_out)",
)
torch.library.define(
    TENSOR_EPS_OP_NAME,
    "(Tensor x, Tensor? residual, Tensor weight, Tensor eps, str group_name) -> (Tensor normed, Tensor residual_out)",
)


@torch.library.register_kernel(OP_NAME, "cpu")
def _allreduce_residual_rmsnorm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference kernel: gloo all-reduce of a copy of `x`, then `add_rmsnorm`."""
    reduced = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=resolve_group(group_name))
    return add_rmsnorm(reduced, residual, weight, eps)


@torch.library.register_kernel(OP_NAME, "cuda")
def _allreduce_residual_rmsnorm_cuda(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel: delegates to `fxfuse.op.cuda_dispatch` (imported on first CUDA call)."""
    from fxfuse.op.cuda_dispatch import allreduce_residual_rmsnorm_cuda

    return allreduce_residual_rmsnorm_cuda(x, residual, weight, eps, group_name)


@torch.library.register_fake(OP_NAME)
def _allreduce_residual_rmsnorm_fake(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes only: both outputs are new tensors shaped and typed like `x` (works with SymInts)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    )


@torch.library.register_kernel(TENSOR_EPS_OP_NAME, ("cpu", "cuda"))
def _allreduce_residual_rmsnorm_tensor_eps(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: torch.Tensor, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `tensor_eps` overload: the float overload with `float(eps)` (a host read for a CPU scalar)."""
    return allreduce_residual_rmsnorm(x, residual, weight, float(eps), group_name)


@torch.library.register_fake(TENSOR_EPS_OP_NAME)
def _allreduce_residual_rmsnorm_tensor_eps_fake(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: torch.Tensor, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes only, as the float overload."""
    return _allreduce_residual_rmsnorm_fake(x, residual, weight, 0.0, group_name)


# The fused op's overloads, as they appear as the targets of nodes in FX graphs.
allreduce_residual_rmsnorm = torch.ops.fxfuse.allreduce_residual_rmsnorm.default
allreduce_residual_rmsnorm_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm.tensor_eps
FUSED_OPS = (allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps)
