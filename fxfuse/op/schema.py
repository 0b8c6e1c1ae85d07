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

Overloads:
- `tensor_eps` takes `eps` as a 0-dim tensor (read with `float(eps)` when the kernel runs): under
  `torch.compile(dynamic=True)` dynamo turns Python float attributes such as a norm's eps into
  float64 scalar tensor inputs of the graph, and the fusion pass then passes that tensor along, so
  the compiled graph still honours a changed eps without a recompile. The pass uses it only for CPU
  scalars, so reading one never synchronizes a GPU.
- `donate_x` and `donate_x_tensor_eps` are the same with `x` marked as written (`Tensor(a!)`): the
  kernel may all-reduce in x's memory instead of a copy. The backend emits them wrapped in
  `auto_functionalized` for Inductor, whose re-inplacing pass passes x itself only where it proves x
  is dead afterwards (else it hands the op a copy), so the graph's values stay those of the
  functional op. What x holds after the call is unspecified.

The CPU kernels (gloo) are the reference (their arithmetic is `fxfuse.op.reference.add_rmsnorm`).
The CUDA kernels live in `fxfuse.op.cuda_dispatch`, imported only when a CUDA tensor reaches the op.
The fake kernels make the op traceable with symbolic token counts. Both outputs are fresh tensors:
they never alias an input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxfuse.op.reference import add_rmsnorm, resolve_group

OP_NAME = "fxfuse::allreduce_residual_rmsnorm"
_RESULTS = "(Tensor normed, Tensor residual_out)"
#: Overload name -> schema of its arguments.
OVERLOADS = {
    "default": "(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name)",
    "tensor_eps": "(Tensor x, Tensor? residual, Tensor weight, Tensor eps, str group_name)",
    "donate_x": "(Tensor(a!) x, Tensor? residual, Tensor weight, float eps, str group_name)",
    "donate_x_tensor_eps": "(Tensor(a!) x, Tensor? residual, Tensor weight, Tensor eps, str group_name)",
}
for _overload, _arguments in OVERLOADS.items():
    torch.library.define(OP_NAME if _overload == "default" else f"{OP_NAME}.{_overload}", f"{_arguments} -> {_RESULTS}")


def _cpu_kernel(x, residual, weight, eps, group_name, x_donated: bool):
    """Reference: gloo all-reduce (in x itself when donated and contiguous), then `add_rmsnorm`."""
    eps = float(eps)
    reduced = x if x_donated and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=resolve_group(group_name))
    normed, residual_out = add_rmsnorm(reduced, residual, weight, eps)
    return normed, residual_out.clone() if residual_out is x else residual_out


def _cuda_kernel(x, residual, weight, eps, group_name, x_donated: bool):
    """Delegates to `fxfuse.op.cuda_dispatch` (imported on the first CUDA call)."""
    from fxfuse.op.cuda_dispatch import allreduce_residual_rmsnorm_cuda

    return allreduce_residual_rmsnorm_cuda(x, residual, weight, float(eps), group_name, x_donated)


def _fake_kernel(x, residual, weight, eps, group_name):
    """Shapes only: both outputs are new tensors shaped and typed like `x` (works with SymInts)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    )


def _register(overload: str) -> None:
    name = OP_NAME if overload == "default" else f"{OP_NAME}.{overload}"
    donated = overload.startswith("donate_x")

    def cpu(x, residual, weight, eps, group_name):
        return _cpu_kernel(x, residual, weight, eps, group_name, donated)

    def cuda(x, residual, weight, eps, group_name):
        return _cuda_kernel(x, residual, weight, eps, group_name, donated)

    cpu.__doc__ = f"CPU reference kernel of `{name}`."
    cuda.__doc__ = f"CUDA kernel of `{name}`."
    torch.library.register_kernel(name, "cpu", cpu)
    torch.library.register_kernel(name, "cuda", cuda)
    torch.library.register_fake(name, _fake_kernel)


for _overload in OVERLOADS:
    _register(_overload)

# The fused op's overloads, as they appear as the targets of nodes in FX graphs.
allreduce_residual_rmsnorm = torch.ops.fxfuse.allreduce_residual_rmsnorm.default
allreduce_residual_rmsnorm_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm.tensor_eps
allreduce_residual_rmsnorm_donate_x = torch.ops.fxfuse.allreduce_residual_rmsnorm.donate_x
allreduce_residual_rmsnorm_donate_x_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm.donate_x_tensor_eps
#: The functional overloads, which the passes emit.
FUSED_OPS = (allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps)
#: Functional overload -> its donating twin.
DONATING_TWIN = {
    allreduce_residual_rmsnorm: allreduce_residual_rmsnorm_donate_x,
    allreduce_residual_rmsnorm_tensor_eps: allreduce_residual_rmsnorm_donate_x_tensor_eps,
}
