"""Residual add + RMSNorm + FP8 quantization in one Triton kernel, with the op's rounding order.

`add_rmsnorm_fp8_into(reduced, residual, weight, eps, recipe, static_scale, residual_out, normed,
quantized, scales)` computes, per row, what `fxfuse.op.kernels.add_rmsnorm_kernel.add_rmsnorm_into` does
(`residual_out = reduced + residual` in the dtype; `normed = weight * (h * rsqrt(mean(h**2) + eps)).to(dtype)`
with `h` in float32), writes `normed` only when given (something else reads it), then quantizes
`normed` to e4m3 as `fxfuse.op.fp8_recipe.quantize_fp8` does: per group of the recipe's size, per row,
or with a static scale, with every step of the recipe (bounds, power-of-two scales in either order
with the scale's bound, reciprocal or division, the clamp to the graph's bound, then the cast as the
installed torch's: saturating, or NaN past 464); the group maximum, its division by 448 (the scale divisor) and the
division of each value by its scale are IEEE float32 operations, as torch computes them; a scale
computed in the activation dtype (torchao) is rounded to it after each step; log2 and exp2 are
CUDA's, as torch's CUDA kernels call them; NaN propagates through maxima and clamps as in torch. One pass over the data after the all-reduce: the
reduced and residual rows are read once; residual_out, the e4m3 values and the scales written once.

`quantize_fp8_into(normed, recipe, static_scale, quantized, scales)` is the same kernel without the add
and the norm, for implementations whose fused all-reduce kernel already wrote `normed` (FlashInfer's
TensorRT-LLM kernel).

One program per row of up to `MAX_HIDDEN` elements; wider rows get the reference arithmetic in torch
operations (never wrong, never after a failure). Compiled kernels are launched directly after their
first JIT call (`fxfuse.op.kernels.triton_launch.DirectLaunch`), as the plain norm kernel is. Runs under
Triton's CPU interpreter in tests (whose float8 casts misround when rounding carries into the
exponent: codes are compared on the GPU).
"""

from __future__ import annotations

import functools

import torch

from fxfuse.op.fp8_recipe import Fp8Limits, Fp8Recipe, cast_saturates, quantize_fp8, rounded_to
from fxfuse.op.kernels.add_rmsnorm_kernel import MAX_HIDDEN, POINTER_ALIGNMENT, next_power_of_2, num_warps_for
from fxfuse.op.kernels.triton_launch import DirectLaunch, launch_hooks_installed
from fxfuse.op.reference import add_rmsnorm

#: `Fp8Recipe.scaling` -> the kernel's SCALING constant.
SCALING_CODES = {"per_group": 0, "per_row": 1, "static_mul": 2, "static_div": 3}
#: `Fp8Recipe.power_of_two` -> the kernel's POWER_OF_TWO constant.
POWER_OF_TWO_CODES = {"none": 0, "ceil": 1, "floor": 2, "nearest": 3}
#: The dtype a dynamic scale is rounded to -> the kernel's SCALE_ROUNDING constant.
SCALE_ROUNDING_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_DIRECT: dict[tuple, DirectLaunch] = {}


@functools.cache
def _kernel():
    from fxfuse.op.kernels.add_rmsnorm_fp8_triton import add_rmsnorm_fp8_rows

    return add_rmsnorm_fp8_rows


def add_rmsnorm_fp8_into(
    reduced: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, recipe: Fp8Recipe,
    static_scale: torch.Tensor | None, residual_out: torch.Tensor, normed: torch.Tensor | None,
    quantized: torch.Tensor, scales: torch.Tensor, weight_offset: float = 0.0, weight_in_fp32: bool = False,
    limits: Fp8Limits = Fp8Limits(),
) -> None:
    """Write `reduced (+ residual)` into `residual_out`, its RMSNorm times `weight` into `normed` (if
    given) and that norm's e4m3 quantization into `quantized` and `scales`.

    Contiguous tensors of one shape [..., hidden] (weight [hidden], scales `fp8_recipe.scale_shape`),
    on one device, with the dtypes `add_rmsnorm_into` takes; `residual_out` may be `reduced`. The weight
    is applied as `fxfuse.op.reference.add_rmsnorm` says (`weight_offset`, `weight_in_fp32`). Safe inside
    CUDA-graph capture once compiled for this recipe, dtype and hidden size.
    """
    _launch(True, reduced, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
            weight_offset, weight_in_fp32, limits)


def quantize_fp8_into(normed: torch.Tensor, recipe: Fp8Recipe, static_scale: torch.Tensor | None,
                      quantized: torch.Tensor, scales: torch.Tensor, limits: Fp8Limits = Fp8Limits()) -> None:
    """`fxfuse.op.fp8_recipe.quantize_fp8(normed, ...)` written into `quantized` and `scales`."""
    _launch(False, normed, None, normed, 0.0, recipe, static_scale, normed, None, quantized, scales, 0.0, False, limits)


def _launch(normalize: bool, source, residual, weight, eps, recipe: Fp8Recipe, static_scale, residual_out, normed,
            quantized, scales, weight_offset: float, weight_in_fp32: bool, limits: Fp8Limits) -> None:
    hidden = source.shape[-1]
    tokens = source.numel() // hidden if hidden else 0
    if tokens == 0:
        return
    if hidden > MAX_HIDDEN:
        _reference_into(normalize, source, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
                        weight_offset, weight_in_fp32, limits)
        return
    has_residual, store_normed = residual is not None, normed is not None
    pointers = (source, residual if has_residual else source, weight, residual_out, normed if store_normed else source,
                quantized, scales if scales.numel() else quantized, static_scale if static_scale is not None else scales)
    scalars, (rows, cols), recipe_constexprs = recipe_terms(recipe, hidden, limits)
    args = (*pointers, hidden, scalars[0], float(eps), *scalars[1:])
    constexprs = (normalize, has_residual, store_normed, *recipe_constexprs[:2], rows, cols, bool(weight_in_fp32),
                  float(weight_offset), *recipe_constexprs[2:], source.is_cuda)
    key = None
    if source.is_cuda:
        device = torch.cuda.current_device()
        key = (device, hidden, constexprs, tuple(t.dtype for t in pointers))
        direct = _DIRECT.get(key)
        if direct is not None and _aligned(pointers) and not launch_hooks_installed():
            direct(tokens, device, args)
            return
    compiled = _kernel()[(tokens,)](*args, *constexprs, num_warps=num_warps_for(rows * cols))
    if key is not None and _aligned(pointers) and key not in _DIRECT:
        _DIRECT[key] = DirectLaunch(compiled, constexprs)


def recipe_terms(recipe: Fp8Recipe, hidden: int, limits: Fp8Limits) -> tuple[tuple, tuple[int, int], tuple]:
    """What a kernel calling `quantize_tile` is given for `recipe` on rows of `hidden`: the runtime scalars
    (groups per row, the lower bound on the maximum, the divisor, the lower bound on the scale, the clamp
    bound), the row's tile (ROWS, COLS), and the constexprs (SCALING, SCALE_ROUNDING, then POWER_OF_TWO,
    BOUND_AFTER_POWER_OF_TWO, RECIPROCAL, SATURATE, CAST_SATURATES)."""
    min_amax, min_scale = limits.bounds(recipe)
    scalars = (max(1, recipe.groups(hidden)), float(min_amax), float(limits.divisor),
               rounded_to(float(min_scale), recipe.scale_dtype), float(limits.clamp))
    if recipe.scaling == "per_group":
        tile = (next_power_of_2(-(-hidden // recipe.group_size)), recipe.group_size)
    else:
        tile = (1, next_power_of_2(hidden))
    constexprs = (SCALING_CODES[recipe.scaling], SCALE_ROUNDING_CODES.get(recipe.scale_dtype, 0),
                  POWER_OF_TWO_CODES[recipe.power_of_two], recipe.bound_after_power_of_two, recipe.reciprocal,
                  recipe.saturate, cast_saturates())
    return scalars, tile, constexprs


def _reference_into(normalize, source, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
                    weight_offset, weight_in_fp32, limits):
    """The reference arithmetic in torch operations, written into the outputs (rows wider than the kernel's)."""
    if normalize:
        normed_value, summed = add_rmsnorm(source, residual, weight, eps, weight_offset, weight_in_fp32)
        residual_out.copy_(summed)
        if normed is not None:
            normed.copy_(normed_value)
    else:
        normed_value = source
    quantized_value, scale_value = quantize_fp8(normed_value, recipe, static_scale, limits)
    quantized.copy_(quantized_value)
    scales.copy_(scale_value.view(scales.shape))


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % POINTER_ALIGNMENT == 0 for t in tensors)
