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

The CPU kernels (gloo) are the reference (their arithmetic is `fxfuse.op.reference.add_rmsnorm`).
The CUDA kernels live in `fxfuse.op.runtime.cuda_dispatch`, imported only when a CUDA tensor reaches the op;
`fxfuse.op.kernels.native_fallback` may put its C++ kernel in front of them (same values, less host time),
which calls back into them through the internal op `allreduce_residual_rmsnorm_planned`.
The fake kernels make the op traceable with symbolic token counts. Both outputs are fresh tensors:
they never alias an input.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fxfuse.op import fp8_schema

from fxfuse.op.kernels import native_fallback
from fxfuse.op.kernels.native_build import load_native_library
from fxfuse.op.reference import NORM_ARGUMENTS, add_rmsnorm, check_arguments
from fxfuse.op.runtime.cpu_kernel import allreduce_residual_rmsnorm_cpu

OP_NAME = "fxfuse::allreduce_residual_rmsnorm"
_RESULTS = "(Tensor normed, Tensor residual_out)"
#: Overload name -> schema of its arguments.
OVERLOADS = {
    "default": f"(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, {NORM_ARGUMENTS})",
    "tensor_eps": f"(Tensor x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {NORM_ARGUMENTS})",
    "donate_x": f"(Tensor(a!) x, Tensor? residual, Tensor weight, float eps, str group_name, {NORM_ARGUMENTS})",
    "donate_x_tensor_eps": f"(Tensor(a!) x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {NORM_ARGUMENTS})",
}


def _overload_name(overload: str) -> str:
    """The op's name with `overload` ("allreduce_residual_rmsnorm[.overload]", no namespace)."""
    name = OP_NAME.removeprefix("fxfuse::")
    return name if overload == "default" else f"{name}.{overload}"


for _overload, _arguments in OVERLOADS.items():
    torch.library.define(f"fxfuse::{_overload_name(_overload)}", f"{_arguments} -> {_RESULTS}")


#: Internal ops of the CUDA path (see `fxfuse.op.kernels.native_fallback`): the Python kernel that decides
#: and runs a call (what the C++ fallback calls for shapes it was not told to run itself), and the
#: fused add-RMSNorm kernel writing into given outputs (what the C++ fallback launches after its
#: all-reduce). Their CPU kernels are the reference, so the C++ path is testable on CPU.
PLANNED_OP = "fxfuse::allreduce_residual_rmsnorm_planned"
torch.library.define(PLANNED_OP, "(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, bool x_donated, "
                                 f"{NORM_ARGUMENTS}) -> {_RESULTS}")
NORM_INTO_OP = "fxfuse::add_rmsnorm_into"
torch.library.define(
    NORM_INTO_OP,
    "(Tensor reduced, Tensor? residual, Tensor weight, float eps, Tensor(a!) residual_out, Tensor(b!) normed) -> ()",
)


@functools.cache
def _cuda_dispatch():
    """`fxfuse.op.runtime.cuda_dispatch`, imported on the first CUDA call (its entry is looked up per call)."""
    from fxfuse.op.runtime import cuda_dispatch

    return cuda_dispatch


@functools.cache
def _norm_into_entry():
    """`fxfuse.op.kernels.add_rmsnorm_kernel.add_rmsnorm_into` (the Triton kernel), imported on first use."""
    from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into

    return add_rmsnorm_into


def _cuda_planned(x, residual, weight, eps, group_name, x_donated, weight_offset=0.0, weight_in_fp32=False):
    """CUDA kernel of `fxfuse::allreduce_residual_rmsnorm_planned`."""
    return _cuda_dispatch().allreduce_residual_rmsnorm_cuda(x, residual, weight, eps, group_name, x_donated, weight_offset,
                                                            weight_in_fp32)


def _cuda_norm_into(reduced, residual, weight, eps, residual_out, normed):
    """CUDA kernel of `fxfuse::add_rmsnorm_into`."""
    _norm_into_entry()(reduced, residual, weight, eps, residual_out, normed)


def _cpu_norm_into(reduced, residual, weight, eps, residual_out, normed):
    """Reference `add_rmsnorm`, written into the given outputs."""
    expected_normed, expected_residual = add_rmsnorm(reduced, residual, weight, eps)
    residual_out.copy_(expected_residual)
    normed.copy_(expected_normed)


def _fake_kernel(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False):
    """Shapes only: both outputs are new tensors shaped like `x` (works with SymInts), `normed` of x's
    dtype, `residual_out` of the residual's; the arguments are checked as the real kernels check them."""
    check_arguments(x, residual, weight, weight_in_fp32)
    contiguous = torch.contiguous_format
    residual_dtype = x.dtype if residual is None else residual.dtype
    return torch.empty_like(x, memory_format=contiguous), torch.empty_like(x, dtype=residual_dtype, memory_format=contiguous)


#: Kernel registrations, held so they live as long as the module (`Library.impl` registers straight
#: into the dispatcher: less host time per call than `torch.library.register_kernel`'s wrappers).
_KERNELS = torch.library.Library("fxfuse", "IMPL")
#: The Python CUDA kernels of the public overloads, in their own library so that
#: `install_native_fallback` can replace them by the C++ kernel.
_python_cuda_kernels: list[torch.library.Library] = []


def _register_cpu_and_fake(overload: str) -> None:
    donated = overload.startswith("donate_x")

    def cpu(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False):
        return allreduce_residual_rmsnorm_cpu(x, residual, weight, eps, group_name, donated, weight_offset, weight_in_fp32)

    cpu.__doc__ = f"CPU reference kernel of `{OP_NAME}.{overload}`."
    _KERNELS.impl(_overload_name(overload), cpu, "CPU")
    torch.library.register_fake(f"fxfuse::{_overload_name(overload)}", _fake_kernel)


def _register_python_cuda_kernels() -> None:
    """Register the Python CUDA kernel (`fxfuse.op.runtime.cuda_dispatch`) of every public overload."""
    library = torch.library.Library("fxfuse", "IMPL")
    for overload in OVERLOADS:
        donated = overload.startswith("donate_x")

        def cuda(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False, donated=donated):
            return _cuda_dispatch().allreduce_residual_rmsnorm_cuda(x, residual, weight, float(eps), group_name, donated,
                                                                    weight_offset, weight_in_fp32)

        cuda.__doc__ = f"CUDA kernel of `{OP_NAME}.{overload}`."
        library.impl(_overload_name(overload), cuda, "CUDA")
    _python_cuda_kernels.append(library)


def install_native_fallback() -> bool:
    """Make the C++ fallback (`fxfuse.op.kernels.native_fallback`) the public overloads' CUDA kernel, once per
    process; False if it cannot be built or loaded here (the Python kernels then stay)."""
    if not native_fallback.installation_decided():
        installed = load_native_library() is not None
        if installed:
            while _python_cuda_kernels:
                _python_cuda_kernels.pop()._destroy()  # Library's teardown (as torch.library._scoped_library uses)
            try:
                torch.ops.fxfuse_native.install()
            except RuntimeError:
                _register_python_cuda_kernels()
                raise
        native_fallback.record_installation(installed)
    return native_fallback.native_installed()


for _overload in OVERLOADS:
    _register_cpu_and_fake(_overload)
_register_python_cuda_kernels()
_KERNELS.impl("allreduce_residual_rmsnorm_planned", allreduce_residual_rmsnorm_cpu, "CPU")
_KERNELS.impl("allreduce_residual_rmsnorm_planned", _cuda_planned, "CUDA")
_KERNELS.impl("add_rmsnorm_into", _cpu_norm_into, "CPU")
_KERNELS.impl("add_rmsnorm_into", _cuda_norm_into, "CUDA")

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
