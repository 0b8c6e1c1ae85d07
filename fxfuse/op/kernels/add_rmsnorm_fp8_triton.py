"""The Triton kernel behind `fxfuse.op.kernels.add_rmsnorm_fp8_kernel` (imported on its first launch, so that
importing the op needs no Triton): residual add + RMSNorm + the FP8 quantization of an
`fxfuse.op.fp8_recipe.Fp8Recipe`, one program per row, and the helpers it calls. The one-kernel PCIe
all-reduce (`fxfuse.op.kernels.one_shot_triton`) calls the same `quantize_tile` (and
`fxfuse.op.kernels.add_rmsnorm_triton.add_rmsnorm_tile`) on the rows it reduces, so both paths run one epilogue."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fxfuse.op.kernels.add_rmsnorm_triton import add_rmsnorm_tile

@triton.jit
def nan_max(a, b):
    """max that returns NaN when either side is NaN (as torch's amax and clamp do)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

@triton.jit
def rounded(value, SCALE_ROUNDING: tl.constexpr):
    """`value` rounded to the scale's dtype (float32: as it is)."""
    if SCALE_ROUNDING == 1:
        value = value.to(tl.bfloat16).to(tl.float32)
    elif SCALE_ROUNDING == 2:
        value = value.to(tl.float16).to(tl.float32)
    return value

@triton.jit
def power_of_two(scale, POWER_OF_TWO: tl.constexpr, SCALE_ROUNDING: tl.constexpr, LIBDEVICE: tl.constexpr):
    """2 ** round(log2(scale)) with the recipe's rounding of the exponent (1 ceil, 2 floor, 3 to nearest,
    half to even), each step rounded to the scale's dtype; log2 and exp2 are CUDA's (torch's on the
    GPU) where compiled, numpy's under Triton's interpreter."""
    if LIBDEVICE:
        exponent = rounded(libdevice.log2(scale), SCALE_ROUNDING)
    else:
        exponent = rounded(tl.log2(scale), SCALE_ROUNDING)
    if POWER_OF_TWO == 1:
        exponent = tl.ceil(exponent)
    elif POWER_OF_TWO == 2:
        exponent = tl.floor(exponent)
    else:
        below = tl.floor(exponent)
        fraction = exponent - below
        odd = below - 2.0 * tl.floor(below * 0.5)
        exponent = tl.where((fraction > 0.5) | ((fraction == 0.5) & (odd == 1.0)), below + 1.0, below)
    if LIBDEVICE:
        return rounded(libdevice.exp2(exponent), SCALE_ROUNDING)
    return rounded(tl.exp2(exponent), SCALE_ROUNDING)

@triton.jit
def divided(x, divisor, reciprocal):
    """x / divisor as IEEE float32 division rounds it, given reciprocal = 1 / divisor (rounded once):
    q = x * reciprocal, then one correction by the exact residual, q + reciprocal * (x - q * divisor),
    with two fused multiply-adds: the correctly rounded quotient for the normal-range values a
    quantization divides, at a fraction of a full division's cost. A zero, infinite or NaN first
    quotient is the IEEE one already (sign included), but for 0 / d with 1 / d infinite, which is 0."""
    quotient = x * reciprocal
    corrected = tl.fma(tl.fma(-quotient, divisor, x), reciprocal, quotient)
    exact = tl.where((x == 0.0) & (divisor != 0.0), x * divisor, quotient)
    return tl.where((quotient != 0.0) & (tl.abs(quotient) < float("inf")), corrected, exact)

@triton.jit
def quantize_tile(
    normed, row, offsets, mask, quantized_ptr, scales_ptr, static_scale_ptr, groups, min_amax, divisor, min_scale,
    clamp_bound, SCALING: tl.constexpr, SCALE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    POWER_OF_TWO: tl.constexpr, BOUND_AFTER_POWER_OF_TWO: tl.constexpr, RECIPROCAL: tl.constexpr,
    SATURATE: tl.constexpr, CAST_SATURATES: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """The FP8 quantization of row `row`, held normed as a [ROWS, COLS] tile: writes its e4m3 codes (and
    its scales, for a dynamic recipe). NaN goes where the unfused torch code has it: maxima and clamps
    propagate it."""
    x = normed.to(tl.float32)
    if SCALING == 2:
        scaled = x * tl.load(static_scale_ptr)
    elif SCALING == 3:
        static_scale = tl.load(static_scale_ptr)
        scaled = divided(x, tl.broadcast_to(static_scale, (ROWS, COLS)),
                         tl.broadcast_to(tl.math.div_rn(1.0, static_scale), (ROWS, COLS)))
    else:
        amax = tl.reduce(tl.abs(x), 1, nan_max)
        if min_amax > 0.0:
            amax = nan_max(amax, min_amax)
        scale = rounded(tl.math.div_rn(rounded(amax, SCALE_ROUNDING), divisor), SCALE_ROUNDING)
        if not BOUND_AFTER_POWER_OF_TWO and min_scale > 0.0:
            scale = nan_max(scale, min_scale)
        if POWER_OF_TWO != 0:
            scale = power_of_two(scale, POWER_OF_TWO, SCALE_ROUNDING, LIBDEVICE)
        if BOUND_AFTER_POWER_OF_TWO:
            scale = nan_max(scale, min_scale)
        group_ids = tl.arange(0, ROWS)
        tl.store(scales_ptr + row * groups + group_ids, scale, mask=group_ids < groups)
        reciprocals = tl.broadcast_to(tl.math.div_rn(1.0, scale)[:, None], (ROWS, COLS))
        if RECIPROCAL:
            scaled = x * reciprocals
        else:
            scaled = divided(x, tl.broadcast_to(scale[:, None], (ROWS, COLS)), reciprocals)
    if SATURATE:  # the code's clamp, to its bound
        scaled = tl.minimum(nan_max(scaled, -clamp_bound), clamp_bound, propagate_nan=tl.PropagateNan.ALL)
    if CAST_SATURATES:  # torch >= 2.13's cast: +-448 beyond the range
        scaled = tl.minimum(nan_max(scaled, -448.0), 448.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        # torch < 2.13's cast (seen on the H200 with 2.11): NaN above 464; 464 itself rounds to 448, as
        # [448, 464) does, which the conversion below gives too
        scaled = tl.where(tl.abs(scaled) > 464.0, float("nan"), scaled)
    tl.store(quantized_ptr + offsets, scaled.to(quantized_ptr.dtype.element_ty), mask=mask)

@triton.jit
def add_rmsnorm_fp8_rows(
    reduced_ptr, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, quantized_ptr, scales_ptr, static_scale_ptr,
    hidden, groups, eps, min_amax, divisor, min_scale, clamp_bound,
    NORMALIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, SCALING: tl.constexpr,
    SCALE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, POWER_OF_TWO: tl.constexpr, BOUND_AFTER_POWER_OF_TWO: tl.constexpr,
    RECIPROCAL: tl.constexpr, SATURATE: tl.constexpr, CAST_SATURATES: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    # One program per token; its row as a [ROWS, COLS] tile: ROWS groups of COLS values for per-group
    # scales (no reshape between the norm and the group maxima), one row of the whole width otherwise.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    mask = cols < hidden
    offsets = row * hidden + cols
    if NORMALIZE:
        reduced = tl.load(reduced_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
        normed = add_rmsnorm_tile(reduced, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, offsets, cols, mask,
                                  hidden, eps, HAS_RESIDUAL, STORE_NORMED, WEIGHT_IN_FP32, WEIGHT_OFFSET)
    else:
        normed = tl.load(reduced_ptr + offsets, mask=mask, other=0.0)
    quantize_tile(normed, row, offsets, mask, quantized_ptr, scales_ptr, static_scale_ptr, groups, min_amax, divisor,
                  min_scale, clamp_bound, SCALING, SCALE_ROUNDING, ROWS, COLS, POWER_OF_TWO, BOUND_AFTER_POWER_OF_TWO,
                  RECIPROCAL, SATURATE, CAST_SATURATES, LIBDEVICE)
