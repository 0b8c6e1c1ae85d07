"""Residual add + RMSNorm + FP8 quantization in one Triton kernel, with the op's rounding order.

`add_rmsnorm_fp8_into(reduced, residual, weight, eps, recipe, static_scale, residual_out, normed,
quantized, scales)` computes, per row, what `fxfuse.op.add_rmsnorm_kernel.add_rmsnorm_into` does
(`residual_out = reduced + residual` in the dtype; `normed = weight * (h * rsqrt(mean(h**2) + eps)).to(dtype)`
with `h` in float32), writes `normed` only when given (something else reads it), then quantizes
`normed` to e4m3 as `fxfuse.op.fp8_recipe.quantize_fp8` does: per group of the recipe's size, per row,
or with a static scale; the group maximum, its division by 448 (the scale divisor) and the division
of each value by its scale are IEEE float32 operations, as torch computes them on the CPU; a scale computed in the
activation dtype (torchao) is rounded to it. One pass over the data after the all-reduce: the
reduced and residual rows are read once; residual_out, the e4m3 values and the scales written once.

`quantize_fp8_into(normed, recipe, static_scale, quantized, scales)` is the same kernel without the add
and the norm, for implementations whose fused all-reduce kernel already wrote `normed` (FlashInfer's
TensorRT-LLM kernel).

One program per row of up to `MAX_HIDDEN` elements; wider rows get the reference arithmetic in torch
operations (never wrong, never after a failure). Compiled kernels are launched directly after their
first JIT call (`fxfuse.op.triton_launch.DirectLaunch`), as the plain norm kernel is. Runs under
Triton's CPU interpreter in tests (whose float8 casts misround when rounding carries into the
exponent: codes are compared on the GPU).
"""

from __future__ import annotations

import functools

import torch

from fxfuse.op.add_rmsnorm_kernel import MAX_HIDDEN, POINTER_ALIGNMENT, next_power_of_2, num_warps_for
from fxfuse.op.fp8_recipe import FP8_MAX, Fp8Recipe, quantize_fp8
from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.triton_launch import DirectLaunch, launch_hooks_installed

#: `Fp8Recipe.scaling` -> the kernel's SCALING constant.
SCALING_CODES = {"per_group": 0, "per_row": 1, "static_mul": 2, "static_div": 3}
#: The dtype a dynamic scale is rounded to -> the kernel's SCALE_ROUNDING constant.
SCALE_ROUNDING_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_DIRECT: dict[tuple, DirectLaunch] = {}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_fp8_rows(
        reduced_ptr, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, quantized_ptr, scales_ptr, static_scale_ptr,
        hidden, groups, eps, min_amax, divisor,
        NORMALIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, SCALING: tl.constexpr,
        SCALE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr,
        WEIGHT_OFFSET: tl.constexpr,
    ):
        # One program per token; its row as a [ROWS, COLS] tile: ROWS groups of COLS values for per-group
        # scales (no reshape between the norm and the group maxima), one row of the whole width otherwise.
        # A division x / d is computed as IEEE float32 division rounds it, from r = 1 / d (rounded to
        # nearest, once per scale): q = x * r, then one correction by the exact residual,
        # q + r * (x - q * d) with two fused multiply-adds: the correctly rounded quotient for the
        # normal-range values a quantization divides, at a fraction of a full division's cost.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        mask = cols < hidden
        offsets = row * hidden + cols
        if NORMALIZE:
            # The cache hints of fxfuse.op.add_rmsnorm_kernel (rows read once, the weight by every program,
            # the residual streamed past L2).
            reduced = tl.load(reduced_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
            summed = reduced
            if HAS_RESIDUAL:
                residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
                summed = reduced.to(residual.dtype) + residual
            tl.store(residual_out_ptr + offsets, summed, mask=mask, cache_modifier=".cs")
            h = summed.to(tl.float32)
            variance = tl.sum(tl.sum(h * h, axis=1), axis=0) / hidden
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
            if WEIGHT_IN_FP32:
                normed = (h * tl.rsqrt(variance + eps) * (weight.to(tl.float32) + WEIGHT_OFFSET)).to(reduced.dtype)
            else:
                normed = weight * (h * tl.rsqrt(variance + eps)).to(summed.dtype)
            if STORE_NORMED:
                tl.store(normed_ptr + offsets, normed, mask=mask)
        else:
            normed = tl.load(reduced_ptr + offsets, mask=mask, other=0.0)
        x = normed.to(tl.float32)
        if SCALING == 2:
            scaled = x * tl.load(static_scale_ptr)
        elif SCALING == 3:
            static_scale = tl.load(static_scale_ptr)
            divisors = tl.broadcast_to(static_scale, (ROWS, COLS))
            reciprocals = tl.broadcast_to(tl.math.div_rn(1.0, static_scale), (ROWS, COLS))
            quotient = x * reciprocals
            scaled = tl.fma(tl.fma(-quotient, divisors, x), reciprocals, quotient)
        else:
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), min_amax)
            scale = tl.math.div_rn(amax, divisor)
            if SCALE_ROUNDING == 1:
                scale = scale.to(tl.bfloat16).to(tl.float32)
            elif SCALE_ROUNDING == 2:
                scale = scale.to(tl.float16).to(tl.float32)
            group_ids = tl.arange(0, ROWS)
            tl.store(scales_ptr + row * groups + group_ids, scale, mask=group_ids < groups)
            divisors = tl.broadcast_to(scale[:, None], (ROWS, COLS))
            reciprocals = tl.broadcast_to(tl.math.div_rn(1.0, scale)[:, None], (ROWS, COLS))
            quotient = x * reciprocals
            scaled = tl.fma(tl.fma(-quotient, divisors, x), reciprocals, quotient)
        clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
        tl.store(quantized_ptr + offsets, clamped.to(quantized_ptr.dtype.element_ty), mask=mask)

    return add_rmsnorm_fp8_rows


def add_rmsnorm_fp8_into(
    reduced: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, recipe: Fp8Recipe,
    static_scale: torch.Tensor | None, residual_out: torch.Tensor, normed: torch.Tensor | None,
    quantized: torch.Tensor, scales: torch.Tensor, weight_offset: float = 0.0, weight_in_fp32: bool = False,
    divisor: float = FP8_MAX,
) -> None:
    """Write `reduced (+ residual)` into `residual_out`, its RMSNorm times `weight` into `normed` (if
    given) and that norm's e4m3 quantization into `quantized` and `scales`.

    Contiguous tensors of one shape [..., hidden] (weight [hidden], scales `fp8_recipe.scale_shape`),
    on one device, with the dtypes `add_rmsnorm_into` takes; `residual_out` may be `reduced`. The weight
    is applied as `fxfuse.op.reference.add_rmsnorm` says (`weight_offset`, `weight_in_fp32`). Safe inside
    CUDA-graph capture once compiled for this recipe, dtype and hidden size.
    """
    _launch(True, reduced, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
            weight_offset, weight_in_fp32, divisor)


def quantize_fp8_into(normed: torch.Tensor, recipe: Fp8Recipe, static_scale: torch.Tensor | None,
                      quantized: torch.Tensor, scales: torch.Tensor, divisor: float = FP8_MAX) -> None:
    """`fxfuse.op.fp8_recipe.quantize_fp8(normed, ...)` written into `quantized` and `scales`."""
    _launch(False, normed, None, normed, 0.0, recipe, static_scale, normed, None, quantized, scales, 0.0, False, divisor)


def _launch(normalize: bool, source, residual, weight, eps, recipe: Fp8Recipe, static_scale, residual_out, normed,
            quantized, scales, weight_offset: float, weight_in_fp32: bool, divisor: float) -> None:
    hidden = source.shape[-1]
    tokens = source.numel() // hidden if hidden else 0
    if tokens == 0:
        return
    if hidden > MAX_HIDDEN:
        _reference_into(normalize, source, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
                        weight_offset, weight_in_fp32, divisor)
        return
    has_residual, store_normed = residual is not None, normed is not None
    min_amax = recipe.min_amax if recipe.scale_dtype == torch.float32 else _rounded(recipe.min_amax, recipe.scale_dtype)
    pointers = (source, residual if has_residual else source, weight, residual_out, normed if store_normed else source,
                quantized, scales if scales.numel() else quantized, static_scale if static_scale is not None else scales)
    args = (*pointers, hidden, max(1, recipe.groups(hidden)), float(eps), float(min_amax), float(divisor))
    if recipe.scaling == "per_group":
        rows, cols = next_power_of_2(-(-hidden // recipe.group_size)), recipe.group_size
    else:
        rows, cols = 1, next_power_of_2(hidden)
    constexprs = (normalize, has_residual, store_normed, SCALING_CODES[recipe.scaling],
                  SCALE_ROUNDING_CODES.get(recipe.scale_dtype, 0), rows, cols, bool(weight_in_fp32), float(weight_offset))
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


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as the nearest `dtype` number (a clamp bound compared in that dtype)."""
    return float(torch.tensor(value, dtype=dtype))


def _reference_into(normalize, source, residual, weight, eps, recipe, static_scale, residual_out, normed, quantized, scales,
                    weight_offset, weight_in_fp32, divisor):
    """The reference arithmetic in torch operations, written into the outputs (rows wider than the kernel's)."""
    if normalize:
        normed_value, summed = add_rmsnorm(source, residual, weight, eps, weight_offset, weight_in_fp32)
        residual_out.copy_(summed)
        if normed is not None:
            normed.copy_(normed_value)
    else:
        normed_value = source
    quantized_value, scale_value = quantize_fp8(normed_value, recipe, static_scale, divisor)
    quantized.copy_(quantized_value)
    scales.copy_(scale_value.view(scales.shape))


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % POINTER_ALIGNMENT == 0 for t in tensors)
