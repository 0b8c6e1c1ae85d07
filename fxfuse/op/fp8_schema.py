"""The fused op's FP8 variant: `torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8`.

`allreduce_residual_rmsnorm_fp8(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name,
str scaling, int group_size, float min_amax, ScalarType scale_dtype, Tensor? static_scale,
bool return_normed, float weight_offset=0., bool weight_in_fp32=False, Tensor? scale_divisor=None,
float min_scale=0., str power_of_two="none", bool reciprocal=False, bool saturate=True,
bool bound_after_power_of_two=False, Tensor? clamp_bound=None, str bounds_from_graph="",
Tensor? amax_bound=None, Tensor? scale_bound=None)
-> (Tensor quantized, Tensor scales, Tensor residual_out, Tensor normed)`

is `allreduce_residual_rmsnorm` (same first five arguments, same `residual_out`, same `normed`
arithmetic) followed by the FP8 e4m3 quantization of `normed` that `fxfuse.op.fp8_recipe.Fp8Recipe(
scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
bound_after_power_of_two, bounds_from_graph)` describes: `quantized` has x's shape, `scales` is
float32 `[..., groups]` for the dynamic scalings (empty for static ones, whose `static_scale` the
caller already holds); a dynamic scale is the group maximum over `scale_divisor`, and a saturating
recipe clamps to +-`clamp_bound` (each 448 when None; a 0-dim CPU tensor where `torch.compile(dynamic=True)`
made the constant a graph input: `fp8_limits`); the bounds that `bounds_from_graph` names are the values
of `amax_bound` and `scale_bound`, 0-dim CPU tensors of the graph. `normed` itself is returned only when `return_normed` (something else reads
the bf16 activations); otherwise it is an empty tensor, never written. The fusion pass
(`fxfuse.passes.fp8_epilogue`) emits it where a quantization reads the norm's output, so that the
all-reduce, the add, the norm and the quantization run as one op (one kernel after the all-reduce).

Overloads as for the plain op: `tensor_eps` (eps a 0-dim CPU tensor), and the donating twins
`donate_x` / `donate_x_tensor_eps` (x may be all-reduced in place). Importing this module defines them
and their fake kernels; `fxfuse.op.runtime.registration` registers the kernels that run them: on CPU
the reference (`fxfuse.op.runtime.cpu_kernel` then `fxfuse.op.fp8_recipe.quantize_fp8`), on CUDA
`fxfuse.op.runtime.cuda_dispatch.allreduce_residual_rmsnorm_fp8_cuda`. Outputs never alias inputs.
"""

from __future__ import annotations

import dataclasses

import torch

from fxfuse.op.fp8_recipe import FP8_DTYPE, FP8_MAX, Fp8Limits, Fp8Recipe, check_fp8_arguments, scale_shape
from fxfuse.op.reference import NORM_ARGUMENTS, check_arguments

FP8_OP_NAME = "fxfuse::allreduce_residual_rmsnorm_fp8"
_RESULTS = "(Tensor quantized, Tensor scales, Tensor residual_out, Tensor normed)"
_QUANT_ARGUMENTS = ("str scaling, int group_size, float min_amax, ScalarType scale_dtype, Tensor? static_scale, bool return_normed, "
                    f"{NORM_ARGUMENTS}, Tensor? scale_divisor=None, float min_scale=0., str power_of_two=\"none\", bool reciprocal=False, "
                    "bool saturate=True, bool bound_after_power_of_two=False, Tensor? clamp_bound=None, str bounds_from_graph=\"\", "
                    "Tensor? amax_bound=None, Tensor? scale_bound=None")
#: Overload name -> its arguments' schema.
FP8_OVERLOADS = {
    "default": f"(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name, {_QUANT_ARGUMENTS})",
    "tensor_eps": f"(Tensor x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {_QUANT_ARGUMENTS})",
    "donate_x": f"(Tensor(a!) x, Tensor? residual, Tensor weight, float eps, str group_name, {_QUANT_ARGUMENTS})",
    "donate_x_tensor_eps": f"(Tensor(a!) x, Tensor? residual, Tensor weight, Tensor eps, str group_name, {_QUANT_ARGUMENTS})",
}


def fp8_overload_name(overload: str) -> str:
    """'allreduce_residual_rmsnorm_fp8[.overload]' (no namespace)."""
    name = FP8_OP_NAME.removeprefix("fxfuse::")
    return name if overload == "default" else f"{name}.{overload}"


for _overload, _arguments in FP8_OVERLOADS.items():
    torch.library.define(f"fxfuse::{fp8_overload_name(_overload)}", f"{_arguments} -> {_RESULTS}")


#: The recipe's fields, in the order `Fp8Recipe` takes them (each is an argument of the op of that name).
RECIPE_FIELDS = tuple(field.name for field in dataclasses.fields(Fp8Recipe))


def recipe_arguments(recipe: Fp8Recipe) -> dict:
    """The op's keyword arguments that carry `recipe`."""
    return {name: getattr(recipe, name) for name in RECIPE_FIELDS}


def argument(node_args: tuple, node_kwargs: dict, name: str):
    """Argument `name` of a call of the FP8 op (an FX node's args and kwargs), given positionally, by
    keyword or left at its schema default."""
    arguments = torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8.default._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == name)
    if len(node_args) > index:
        return node_args[index]
    return node_kwargs[name] if name in node_kwargs else arguments[index].default_value


def recipe_of(node_args: tuple, node_kwargs: dict) -> Fp8Recipe:
    """The recipe a call of the FP8 op (an FX node's args and kwargs) quantizes with."""
    return Fp8Recipe(*(argument(node_args, node_kwargs, name) for name in RECIPE_FIELDS))


def recipe_from_arguments(scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
                          bound_after_power_of_two, bounds_from_graph) -> Fp8Recipe:
    """The recipe the op's recipe arguments describe (as its kernels receive them)."""
    return Fp8Recipe(scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
                     bound_after_power_of_two, bounds_from_graph)


def fp8_limits(scale_divisor: torch.Tensor | None, clamp_bound: torch.Tensor | None, amax_bound: torch.Tensor | None = None,
               scale_bound: torch.Tensor | None = None) -> Fp8Limits:
    """The numbers a call quantizes with: the divisor and clamp bound (448 each, or the value of the 0-dim
    CPU tensor the graph passes in), and the graph's bounds on the maximum and the scale, if given."""
    def value(tensor, default):
        return default if tensor is None else float(tensor)

    return Fp8Limits(value(scale_divisor, FP8_MAX), value(clamp_bound, FP8_MAX), value(amax_bound, None),
                     value(scale_bound, None))


def _fake_fp8_kernel(x, residual, weight, eps, group_name, scaling, group_size, min_amax, scale_dtype, static_scale,
                     return_normed, weight_offset=0.0, weight_in_fp32=False, scale_divisor=None, min_scale=0.0,
                     power_of_two="none", reciprocal=False, saturate=True, bound_after_power_of_two=False,
                     clamp_bound=None, bounds_from_graph="", amax_bound=None, scale_bound=None):
    """Shapes only (works with SymInts); the arguments are checked as the real kernels check them."""
    check_arguments(x, residual, weight, weight_in_fp32)
    recipe = recipe_from_arguments(scaling, group_size, min_amax, scale_dtype, min_scale, power_of_two, reciprocal, saturate,
                                   bound_after_power_of_two, bounds_from_graph)
    check_fp8_arguments(x.shape, recipe, static_scale, x.device)
    contiguous = torch.contiguous_format
    return (torch.empty_like(x, dtype=FP8_DTYPE, memory_format=contiguous),
            x.new_empty(scale_shape(x.shape, recipe), dtype=torch.float32),
            torch.empty_like(x, dtype=x.dtype if residual is None else residual.dtype, memory_format=contiguous),
            torch.empty_like(x, memory_format=contiguous) if return_normed else x.new_empty(0))


for _overload in FP8_OVERLOADS:
    torch.library.register_fake(f"fxfuse::{fp8_overload_name(_overload)}", _fake_fp8_kernel)

allreduce_residual_rmsnorm_fp8 = torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8.default
allreduce_residual_rmsnorm_fp8_tensor_eps = torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8.tensor_eps
#: The FP8 variant's functional overloads, which the FP8 epilogue pass emits.
FP8_OPS = (allreduce_residual_rmsnorm_fp8, allreduce_residual_rmsnorm_fp8_tensor_eps)
#: Functional overload -> its donating twin.
FP8_DONATING_TWIN = {
    allreduce_residual_rmsnorm_fp8: torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8.donate_x,
    allreduce_residual_rmsnorm_fp8_tensor_eps: torch.ops.fxfuse.allreduce_residual_rmsnorm_fp8.donate_x_tensor_eps,
}
