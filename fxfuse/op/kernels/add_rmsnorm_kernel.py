"""One fused residual-add + RMSNorm kernel (Triton), with the op's rounding order.

`add_rmsnorm_into(reduced, residual, weight, eps, residual_out, normed)` computes, per row,
`residual_out = reduced + residual` rounded to the residual's dtype, then
`normed = weight * (h * rsqrt(mean(h**2) + eps)).to(dtype)` with `h = residual_out` in float32 (or,
with `weight_in_fp32`, the weight plus `weight_offset` applied in float32 before the cast):
exactly `fxfuse.op.reference.add_rmsnorm`, in one pass over the data. It is what the fused op's
non-FlashInfer paths run after their all-reduce (NCCL, or FlashInfer's PCIe all-reduce), so that a
site whose collective is not fused still costs one norm kernel, as the unfused graph compiled by
Inductor does. `residual_out` may be `reduced` itself (the add is then done in place).

One program handles one row (a token) of up to `MAX_HIDDEN` elements held in registers; the number
of warps grows with the row width. Cache hints: the rows read are read once (evict first), the weight
is read by every program (evict last), and the residual written is read only by a later layer
(streamed past L2, `.cs`), while the normed output, which the next GEMM reads at once, stays in L2.
On the H200, with a GEMM before the norm and the calls' inputs cycled past L2 (`fxfuse bench
fallback`), the hints and 8 warps at 8192 took the block of 1024 tokens x 7168 from 6% behind
Inductor's compiled add + norm to 8% ahead (1.061 -> 0.924), 4096 x 4096 from 0.984 to 0.932; at
4096 x 7168 both stay at the memory roofline (0.984 -> 0.991).

Wider rows (no model has them; the fusion pass leaves such CUDA sites to Inductor when their width
is known at compile time) get the reference arithmetic in torch operations, written into the same
outputs: slower, never wrong, and never after a failure. Triton is imported on first use only (it
comes with CUDA builds of torch); the kernel also runs under Triton's CPU interpreter
(`TRITON_INTERPRET=1`) for tests.

Host cost: the first CUDA launch of each (device, hidden, residual or not, dtypes) goes through
Triton's JIT, which compiles and returns the compiled kernel; later launches of that key call the
compiled kernel's launcher directly (`fxfuse.op.kernels.triton_launch`), skipping the JIT's per-call argument
binding and cache lookup, as Inductor does for its own kernels. That is valid because everything the
JIT specializes on is in the key or checked per call (16-byte aligned pointers). The compiled
kernel is also registered with the op's C++ fallback (`fxfuse.op.kernels.native_fallback`), which then
launches it itself.
"""

from __future__ import annotations

import functools

import torch

from fxfuse.op.kernels.native_fallback import offer_norm_kernel
from fxfuse.op.kernels.triton_launch import DirectLaunch, launch_hooks_installed
from fxfuse.op.reference import add_rmsnorm

#: Widest row one program holds (elements); wider rows are not supported by this kernel.
MAX_HIDDEN = 65536
#: Pointer alignment the direct launch relies on (what Triton specializes pointers on).
POINTER_ALIGNMENT = 16
#: The compiled kernel's runtime parameters as PTX types: five pointers, the int32 row width, the float32 eps.
PTX_PARAMETERS = ["u64"] * 5 + ["u32", "f32"]

#: (device index, hidden, has residual, the five tensors' dtypes) -> the compiled kernel's direct launch.
_DIRECT: dict[tuple, DirectLaunch] = {}


def num_warps_for(block: int) -> int:
    """Warps per program for a row block of `block` elements (a power of two): about 512 elements per
    warp up to blocks of 4096, 1024 above (8 warps at 8192: on the H200, hidden 7168 after a GEMM, 8 warps
    ran the norm of 1024 tokens 2% faster than 16 and that of 4096 tokens within 1%), between 1 and 16
    warps, so each thread loads a few 16-byte vectors."""
    return max(1, min(16, block // (512 if block <= 4096 else 1024)))


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    from fxfuse.op.kernels.add_rmsnorm_triton import add_rmsnorm_rows

    return add_rmsnorm_rows


def add_rmsnorm_into(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor,
    normed: torch.Tensor,
    weight_offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> None:
    """Write `reduced (+ residual)` into `residual_out` and its RMSNorm times the weight into `normed`,
    the weight applied as `fxfuse.op.reference.add_rmsnorm` says.

    All tensors are contiguous and of one shape [..., hidden] (weight [hidden]), on one device, of
    `reduced`'s dtype but a float32 residual / residual_out (a float32 residual stream) or a float32
    weight (applied in float32); `residual_out` may be `reduced` when their dtypes agree. Safe inside
    CUDA-graph capture once compiled for these dtypes and this hidden size (call it once outside
    capture first: Triton compiles on first use).
    """
    hidden = reduced.shape[-1]
    tokens = reduced.numel() // hidden if hidden else 0
    if tokens == 0:
        return
    has_residual = residual is not None
    args = (reduced, residual if has_residual else reduced, weight, residual_out, normed, hidden, float(eps))
    if reduced.is_cuda:
        device = torch.cuda.current_device()
        key = (device, hidden, has_residual, reduced.dtype, args[1].dtype, weight.dtype, residual_out.dtype, normed.dtype,
               float(weight_offset), bool(weight_in_fp32))
        direct = _DIRECT.get(key)
        if direct is not None and _aligned(args[:5]) and not launch_hooks_installed():
            direct(tokens, device, args)
            return
    if hidden > MAX_HIDDEN:
        normed_value, summed = add_rmsnorm(reduced, residual, weight, eps, weight_offset, weight_in_fp32)
        residual_out.copy_(summed)
        normed.copy_(normed_value)
        return
    block = next_power_of_2(hidden)
    constexprs = (has_residual, block, bool(weight_in_fp32), float(weight_offset))
    compiled = _kernel()[(tokens,)](*args, *constexprs, num_warps=num_warps_for(block))
    if reduced.is_cuda and _aligned(args[:5]) and key not in _DIRECT:
        _DIRECT[key] = DirectLaunch(compiled, constexprs)
        offer_norm_kernel(key, compiled, PTX_PARAMETERS)


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % POINTER_ALIGNMENT == 0 for t in tensors)
