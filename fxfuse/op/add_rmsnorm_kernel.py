"""One fused residual-add + RMSNorm kernel (Triton), with the op's rounding order.

`add_rmsnorm_into(reduced, residual, weight, eps, residual_out, normed)` computes, per row,
`residual_out = reduced + residual` rounded to the dtype, then
`normed = weight * (h * rsqrt(mean(h**2) + eps)).to(dtype)` with `h = residual_out` in float32:
exactly `fxfuse.op.reference.add_rmsnorm`, in one pass over the data. It is what the fused op's
non-FlashInfer paths run after their all-reduce (NCCL, or FlashInfer's PCIe all-reduce), so that a
site whose collective is not fused still costs one norm kernel, as the unfused graph compiled by
Inductor does. `residual_out` may be `reduced` itself (the add is then done in place).

One program handles one row (a token) of up to `MAX_HIDDEN` elements held in registers; the number
of warps grows with the row width. Triton is imported on first use only (it comes with CUDA builds of
torch); the kernel also runs under Triton's CPU interpreter (`TRITON_INTERPRET=1`) for tests.
"""

from __future__ import annotations

import functools

import torch

#: Widest row one program holds (elements); wider rows are not supported by this kernel.
MAX_HIDDEN = 65536


def num_warps_for(block: int) -> int:
    """Warps per program for a row block of `block` elements (a power of two): about 512 elements
    per warp, between 1 and 16 warps, so each thread loads a few 16-byte vectors."""
    return max(1, min(16, block // 512))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_rows(
        reduced_ptr, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr,
        hidden, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        offsets = row * hidden + cols
        summed = tl.load(reduced_ptr + offsets, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            summed = summed + tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        tl.store(residual_out_ptr + offsets, summed, mask=mask)
        h = summed.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / hidden
        normalized = (h * tl.rsqrt(variance + eps)).to(summed.dtype)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        tl.store(normed_ptr + offsets, weight * normalized, mask=mask)

    return add_rmsnorm_rows


def add_rmsnorm_into(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor,
    normed: torch.Tensor,
) -> None:
    """Write `reduced (+ residual)` into `residual_out` and its RMSNorm times `weight` into `normed`.

    All tensors are contiguous [tokens, hidden] (weight [hidden]) of one dtype on one device;
    `residual_out` may be `reduced`. Safe inside CUDA-graph capture once compiled for this dtype and
    hidden size (call it once outside capture first: Triton compiles on first use).
    """
    tokens, hidden = reduced.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the fused add-RMSNorm kernel's {MAX_HIDDEN}")
    if tokens == 0:
        return
    import triton

    block = triton.next_power_of_2(hidden)
    _kernel()[(tokens,)](
        reduced, residual if residual is not None else reduced, weight, residual_out, normed,
        hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block),
    )
