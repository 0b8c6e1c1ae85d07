"""The Triton kernel behind `fxfuse.op.kernels.add_rmsnorm_kernel`, and the residual add + RMSNorm of one row held
as a tile that it runs: the code every fxfuse kernel with a norm runs (this one, its FP8 form, the one-kernel PCIe
all-reduce), imported on their first launch, so that importing the op needs no Triton."""

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_tile(
    reduced, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, offsets, cols, mask, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
):
    """The residual add and RMSNorm of one all-reduced row held as a [ROWS, COLS] tile (`offsets`: its
    elements' offsets, `cols`: their columns): writes residual_out (and normed, if STORE_NORMED) and returns
    normed. The cache hints of fxfuse.op.kernels.add_rmsnorm_kernel (rows read once, the weight by every
    program, the residual streamed past L2)."""
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
    return normed


@triton.jit
def add_rmsnorm_rows(
    reduced_ptr, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
):
    # the row as a [1, BLOCK] tile: the same PTX as a 1-D row (compared on SM 9.0, Triton 3.6 and 3.9)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, 1)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = cols < hidden
    offsets = row * hidden + cols
    reduced = tl.load(reduced_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    add_rmsnorm_tile(reduced, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, offsets, cols, mask, hidden, eps,
                     HAS_RESIDUAL, True, WEIGHT_IN_FP32, WEIGHT_OFFSET)
