"""The fused collective+norm op: `torch.ops.fxfuse.allreduce_residual_rmsnorm`.

Schema (fixed by docs/ARCHITECTURE.md):
`allreduce_residual_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name,
float weight_offset=0., bool weight_in_fp32=False) -> (Tensor normed, Tensor residual_out)`.

Semantics (`fxfuse.op.reference.add_rmsnorm`), with `dtype = x.dtype`:
- `reduced = all_reduce_sum(x)` over the process group named `group_name`, in `dtype`;
- `residual_out = reduced + residual` in the residual's dtype (`dtype`, or float32 for a float32
  residual stream: `reduced` is converted first), just `reduced` when residual is None;
- `normed`, in `dtype`, is the RMSNorm of `h = residual_out` in float32 times the weight: by default in
  the Hugging Face transformers order `weight * (h * rsqrt(mean(h**2, -1) + eps)).to(dtype)` (cast
  back, THEN the weight in `dtype`); with `weight_in_fp32`, `((h * rsqrt(...)) * (weight.float() +
  weight_offset)).to(dtype)`: the weight applied in float32 before the single cast (`F.rms_norm`;
  Gemma's zero-centred `1 + weight` with `weight_offset` 1.0). A weight or residual of another dtype
  than x's is float32 and needs `weight_in_fp32`.

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

Importing this module defines the op's overloads and their fake kernels, which make the op traceable
with symbolic token counts: enough to trace, rewrite and compile graphs. The kernels that run it are
registered by `fxfuse.op.runtime.registration` (the backend, `fxfuse.post_grad_pass` and
`fxfuse.prepare` import it): on CPU the reference over gloo (its arithmetic is
`fxfuse.op.reference.add_rmsnorm`), on CUDA the plans of `fxfuse.op.runtime.cuda_dispatch`, in front
of which the C++ fallback (`fxfuse.op.kernels.native_fallback`) may sit. Both outputs are fresh
tensors: they never alias an input.
"""

from __future__ import annotations

import torch

from fxfuse.op import fp8_schema
from fxfuse.op.reference import NORM_ARGUMENTS, check_arguments

OP_NAME = "fxfuse::allreduce_residual_rmsnorm"
#: What every overload returns.
RESULTS = "(Tensor normed, Tensor residual_out)"
#: Overload name -> schema of its arguments.
OVERLOADS = {
    "default": f"(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, {NORM_ARGUMENTS})",
    "tensor_eps": f"(Tensor x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {NORM_ARGUMENTS})",
    "donate_x": f"(Tensor(a!) x, Tensor? residual, Tensor weight, float eps, str group_name, {NORM_ARGUMENTS})",
    "donate_x_tensor_eps": f"(Tensor(a!) x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {NORM_ARGUMENTS})",
}


def overload_name(overload: str) -> str:
    """The op's name with `overload` ("allreduce_residual_rmsnorm[.overload]", no namespace)."""
    name = OP_NAME.removeprefix("fxfuse::")
    return name if overload == "default" else f"{name}.{overload}"


def _fake_kernel(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False):
    """Shapes only: both outputs are new tensors shaped like `x` (works with SymInts), `normed` of x's
    dtype, `residual_out` of the residual's; the arguments are checked as the real kernels check them."""
    check_arguments(x, residual, weight, weight_in_fp32)
    contiguous = torch.contiguous_format
    residual_dtype = x.dtype if residual is None else residual.dtype
    return torch.empty_like(x, memory_format=contiguous), torch.empty_like(x, dtype=residual_dtype, memory_format=contiguous)


for _overload, _arguments in OVERLOADS.items():
    torch.library.define(f"fxfuse::{overload_name(_overload)}", f"{_arguments} -> {RESULTS}")
    torch.library.register_fake(f"fxfuse::{overload_name(_overload)}", _fake_kernel)

# The fused op's overloads, as they appear as the targets of nodes in FX graphs.
allreduce_residual_rmsnorm = torch.ops.fxfuse.allreduce_residual_rmsnorm.default
allreduce_residual_rmsnorm_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm.tensor_eps
allreduce_residual_rmsnorm_donate_x = torch.ops.fxfuse.allreduce_residual_rmsnorm.donate_x
allreduce_residual_rmsnorm_donate_x_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm.donate_x_tensor_eps
#: The plain op's functional overloads, which the norm fusion pass emits.
NORM_OPS = (allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps)
#: Every functional overload of the fused ops (plain and FP8): their first five arguments are
#: (x, residual, weight, eps, group_name) alike.
FUSED_OPS = NORM_OPS + fp8_schema.FP8_OPS
#: Functional overload -> its donating twin.
DONATING_TWIN = {
    allreduce_residual_rmsnorm: allreduce_residual_rmsnorm_donate_x,
    allreduce_residual_rmsnorm_tensor_eps: allreduce_residual_rmsnorm_donate_x_tensor_eps,
    **fp8_schema.FP8_DONATING_TWIN,
}
