"""The fused ops' kernels, registered with torch's dispatcher: what makes `torch.ops.fxfuse.*` run.

`fxfuse.op.schema`, `fxfuse.op.fp8_schema` and `fxfuse.op.all_reduce_schema` define the ops and their fake
kernels; importing this module gives every overload of each its kernels:
- CPU: the reference over gloo (`fxfuse.op.runtime.cpu_kernel`; for the FP8 variant then
  `fxfuse.op.fp8_recipe.quantize_fp8`);
- CUDA: `fxfuse.op.runtime.cuda_dispatch`, imported on the first CUDA call (its entry points are looked
  up per call), which runs the plan cached for the call's shape.
The all-reduce-only ops (`all_reduce`, `all_reduce_`) get a gloo all-reduce on CPU (after the group's
agreement, as the fused op's CPU kernel) and `cuda_dispatch.all_reduce_cuda` on CUDA, which the C++
fallback replaces too, calling back through `all_reduce_planned` / `all_reduce_planned_`.
`install_native_fallback()` (called by `fxfuse.prepare` and by the backend when it compiles a graph
with fused sites on CUDA) replaces the plain op's Python CUDA kernels by the C++ fallback
(`fxfuse.op.kernels.native_fallback`), which calls back into Python through two internal ops defined
here: `allreduce_residual_rmsnorm_planned` (the Python kernel that decides and runs a call) and
`add_rmsnorm_into` (the fused add-RMSNorm kernel writing into given outputs). Their CPU kernels are
the reference, so the C++ path is testable on CPU.
"""

from __future__ import annotations

import functools

import torch

from fxfuse.op.all_reduce_schema import IN_PLACE_SCHEMA, SCHEMA
from fxfuse.op.fp8_recipe import Fp8Limits, Fp8Recipe, check_fp8_arguments, quantize_fp8
from fxfuse.op.fp8_schema import FP8_OP_NAME, FP8_OVERLOADS, fp8_overload_name, recipe_from_arguments, fp8_limits
from fxfuse.op.kernels import native_fallback
from fxfuse.op.kernels.native_build import load_native_library
from fxfuse.op.reference import NORM_ARGUMENTS, add_rmsnorm
from fxfuse.op.runtime.cpu_kernel import all_reduce_cpu, all_reduce_in_place_cpu, allreduce_residual_rmsnorm_cpu
from fxfuse.op.schema import OP_NAME, OVERLOADS, RESULTS, overload_name

#: Internal ops of the CUDA path (see `fxfuse.op.kernels.native_fallback`): the Python kernel that
#: decides and runs a call (what the C++ fallback calls for shapes it was not told to run itself), and
#: the fused add-RMSNorm kernel writing into given outputs (what the C++ fallback launches after its
#: all-reduce).
PLANNED_OP = "fxfuse::allreduce_residual_rmsnorm_planned"
torch.library.define(PLANNED_OP, "(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, bool x_donated, "
                                 f"{NORM_ARGUMENTS}) -> {RESULTS}")
NORM_INTO_OP = "fxfuse::add_rmsnorm_into"
torch.library.define(
    NORM_INTO_OP,
    "(Tensor reduced, Tensor? residual, Tensor weight, float eps, Tensor(a!) residual_out, Tensor(b!) normed) -> ()",
)
#: The all-reduce-only ops' Python CUDA kernels under names of their own, which the C++ fallback calls
#: for the shapes it was not told to run itself.
ALL_REDUCE_PLANNED_OP = "fxfuse::all_reduce_planned"
torch.library.define(ALL_REDUCE_PLANNED_OP, SCHEMA)
ALL_REDUCE_PLANNED_IN_PLACE_OP = "fxfuse::all_reduce_planned_"
torch.library.define(ALL_REDUCE_PLANNED_IN_PLACE_OP, IN_PLACE_SCHEMA)


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


def _cuda_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Python CUDA kernel of `fxfuse::all_reduce`."""
    return _cuda_dispatch().all_reduce_cuda(x, group_name, False)


def _cuda_all_reduce_(x: torch.Tensor, group_name: str) -> None:
    """Python CUDA kernel of `fxfuse::all_reduce_`."""
    _cuda_dispatch().all_reduce_cuda(x, group_name, True)


def _cpu_fp8_kernel(x, residual, weight, eps, group_name, recipe: Fp8Recipe, static_scale, return_normed, weight_offset,
                    weight_in_fp32, limits: Fp8Limits, x_donated: bool):
    """Reference: the plain op's CPU kernel, then `quantize_fp8` of its normed output."""
    check_fp8_arguments(x.shape, recipe, static_scale, x.device)
    normed, residual_out = allreduce_residual_rmsnorm_cpu(x, residual, weight, eps, group_name, x_donated, weight_offset,
                                                          weight_in_fp32)
    quantized, scales = quantize_fp8(normed, recipe, static_scale, limits)
    return quantized, scales, residual_out, normed if return_normed else normed.new_empty(0)


#: Kernel registrations, held so they live as long as the module (`Library.impl` registers straight
#: into the dispatcher: less host time per call than `torch.library.register_kernel`'s wrappers).
_KERNELS = torch.library.Library("fxfuse", "IMPL")
#: The Python CUDA kernels of the plain op's public overloads, in their own library so that
#: `install_native_fallback` can replace them by the C++ kernel.
_python_cuda_kernels: list[torch.library.Library] = []


def _register_cpu(overload: str) -> None:
    donated = overload.startswith("donate_x")

    def cpu(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False):
        return allreduce_residual_rmsnorm_cpu(x, residual, weight, eps, group_name, donated, weight_offset, weight_in_fp32)

    cpu.__doc__ = f"CPU reference kernel of `{OP_NAME}.{overload}`."
    _KERNELS.impl(overload_name(overload), cpu, "CPU")


def _register_python_cuda_kernels() -> None:
    """Register the Python CUDA kernel (`fxfuse.op.runtime.cuda_dispatch`) of every public overload."""
    library = torch.library.Library("fxfuse", "IMPL")
    library.impl("all_reduce", _cuda_all_reduce, "CUDA")
    library.impl("all_reduce_", _cuda_all_reduce_, "CUDA")
    for overload in OVERLOADS:
        donated = overload.startswith("donate_x")

        def cuda(x, residual, weight, eps, group_name, weight_offset=0.0, weight_in_fp32=False, donated=donated):
            return _cuda_dispatch().allreduce_residual_rmsnorm_cuda(x, residual, weight, float(eps), group_name, donated,
                                                                    weight_offset, weight_in_fp32)

        cuda.__doc__ = f"CUDA kernel of `{OP_NAME}.{overload}`."
        library.impl(overload_name(overload), cuda, "CUDA")
    _python_cuda_kernels.append(library)


def _register_fp8(overload: str) -> None:
    donated = overload.startswith("donate_x")

    def cpu(x, residual, weight, eps, group_name, scaling, group_size, min_amax, scale_dtype, static_scale, return_normed,
            weight_offset=0.0, weight_in_fp32=False, scale_divisor=None, min_scale=0.0, power_of_two="none",
            reciprocal=False, saturate=True, bound_after_power_of_two=False, clamp_bound=None, bounds_from_graph="",
            amax_bound=None, scale_bound=None):
        recipe = recipe_from_arguments(scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
                                       bound_after_power_of_two, bounds_from_graph)
        return _cpu_fp8_kernel(x, residual, weight, eps, group_name, recipe, static_scale, return_normed, weight_offset,
                               weight_in_fp32, fp8_limits(scale_divisor, clamp_bound, amax_bound, scale_bound), donated)

    def cuda(x, residual, weight, eps, group_name, scaling, group_size, min_amax, scale_dtype, static_scale, return_normed,
             weight_offset=0.0, weight_in_fp32=False, scale_divisor=None, min_scale=0.0, power_of_two="none",
             reciprocal=False, saturate=True, bound_after_power_of_two=False, clamp_bound=None, bounds_from_graph="",
             amax_bound=None, scale_bound=None):
        recipe = recipe_from_arguments(scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
                                       bound_after_power_of_two, bounds_from_graph)
        return _cuda_dispatch().allreduce_residual_rmsnorm_fp8_cuda(
            x, residual, weight, float(eps), group_name, recipe, static_scale, return_normed, donated, weight_offset,
            weight_in_fp32, fp8_limits(scale_divisor, clamp_bound, amax_bound, scale_bound))

    cpu.__doc__ = f"CPU reference kernel of `{FP8_OP_NAME}.{overload}`."
    cuda.__doc__ = f"CUDA kernel of `{FP8_OP_NAME}.{overload}`."
    _KERNELS.impl(fp8_overload_name(overload), cpu, "CPU")
    _KERNELS.impl(fp8_overload_name(overload), cuda, "CUDA")


def install_native_fallback() -> bool:
    """Make the C++ fallback (`fxfuse.op.kernels.native_fallback`) the public overloads' CUDA kernel, once
    per process; False if it cannot be built or loaded here (the Python kernels then stay)."""
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


for _overload in FP8_OVERLOADS:
    _register_fp8(_overload)
for _overload in OVERLOADS:
    _register_cpu(_overload)
_register_python_cuda_kernels()
_KERNELS.impl("allreduce_residual_rmsnorm_planned", allreduce_residual_rmsnorm_cpu, "CPU")
_KERNELS.impl("allreduce_residual_rmsnorm_planned", _cuda_planned, "CUDA")
_KERNELS.impl("add_rmsnorm_into", _cpu_norm_into, "CPU")
_KERNELS.impl("add_rmsnorm_into", _cuda_norm_into, "CUDA")
for _name, _cpu, _cuda in (("all_reduce", all_reduce_cpu, None), ("all_reduce_", all_reduce_in_place_cpu, None),
                           ("all_reduce_planned", all_reduce_cpu, _cuda_all_reduce),
                           ("all_reduce_planned_", all_reduce_in_place_cpu, _cuda_all_reduce_)):
    _KERNELS.impl(_name, _cpu, "CPU")
    if _cuda is not None:
        _KERNELS.impl(_name, _cuda, "CUDA")
