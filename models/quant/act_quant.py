"""Per-token-group FP8 activation quantization in one Triton kernel: the GPU path of
`fxfuse.models.quant.reference.quantize_activations` ("w8a8" GEMMs quantize their input on every call,
and the reference's seven small torch kernels, run one by one, cost more than a decode-size GEMM).

One program per (row, group): the group's max |x| (at least MIN_ACTIVATION_AMAX), scale = max / 448,
q = clamp(x / scale) rounded to e4m3, in float32 with IEEE round-to-nearest divisions. The reference
gives the same values up to float32 rounding of the scale (on the GPU torch divides by a scalar as a
product with its reciprocal), so a value on an e4m3 rounding boundary may get the neighbouring code.
`quantize_activations(x, group)` runs it for CUDA tensors and the reference elsewhere (the routed
experts' op quantizes with it); `quantize_activations_triton` runs the kernel on any device (Triton's
CPU interpreter in tests). `quantize_linear_input(x, group)` is the quantization of a w8a8 dense
linear's input: under torch.compile the reference's plain torch ops, so that they are traced into the
graph right after the RMSNorm (or other op) that produced x and a compiler can fuse them with it, or
fxfuse fold them into its fused all-reduce + RMSNorm op; uncompiled, `quantize_activations`.
"""

from __future__ import annotations

import functools
import os

import torch

from fxfuse.models.fp8 import FP8_DTYPE, FP8_MAX
from fxfuse.models.quant import reference


@functools.cache
def _kernel(interpret: str | None):
    """The Triton kernel, decorated now (so the interpreter setting of this moment applies)."""
    import triton
    import triton.language as tl

    def quantize_groups(x_ptr, q_ptr, scale_ptr, cols, stride_xm, stride_qm, stride_sm, fp8_max, min_amax,
                        GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        offs = group * GROUP + tl.arange(0, GROUP)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax)
        scale = tl.math.div_rn(amax, fp8_max)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row * stride_sm + group, scale)

    return triton.jit(quantize_groups)


def quantize_activations_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_activations(x, group)` by the Triton kernel: (float8_e4m3fn [M, K], float32 [M, ceil(K / group)])."""
    if group & (group - 1):
        raise ValueError(f"the activation-quantization kernel needs a power-of-two group size, got {group}")
    rows, cols = x.shape
    groups = -(-cols // group)
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _kernel(os.environ.get("TRITON_INTERPRET"))[(rows, groups)](
            x, quantized, scale, cols, x.stride(0), quantized.stride(0), scale.stride(0),
            FP8_MAX, reference.MIN_ACTIVATION_AMAX, GROUP=group,
        )
    return quantized, scale


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization of contiguous-row x [M, K]: the Triton kernel on CUDA, else the reference."""
    if x.is_cuda and x.stride(1) == 1 and not group & (group - 1):
        return quantize_activations_triton(x, group)
    return reference.quantize_activations(x, group)


def quantize_linear_input(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization of a w8a8 dense linear's input x [M, K]: while torch.compile traces, the
    reference's torch ops (into the graph, no custom op around them); uncompiled, `quantize_activations`."""
    if torch.compiler.is_compiling():
        return reference.quantize_activations(x, group)
    return quantize_activations(x, group)
