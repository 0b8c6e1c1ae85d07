"""cuBLAS block-scaled FP8 GEMM through `torch._scaled_mm`: 1 x 128 activation scales, 128 x 128 weight scales.

torch (2.9 and later, CUDA 12.9+, SM 9.0) accepts `torch._scaled_mm(a [M, K] fp8 row-major,
b [K, N] fp8 column-major, scale_a, scale_b)` with scale_a float32 [M, ceil(K / 128)] "outer-dim-major"
(stride (1, M)) and scale_b float32 [ceil(K / 128), ceil(N / 128)] whose transpose is row-major with
16-byte aligned rows (aten/src/ATen/native/cuda/ScaledBlas.cpp: `is_blockwise_1x128_scaling`,
`is_blockwise_128x128_scaling`, the (BlockWise1x128, BlockWise128x128) pair). Support varies with
the torch build and the GPU (SM 10.x refuses these modes), so `blockwise_scaled_mm_works(device)`
tries it once per device on small shapes against the dequantized reference, outside any CUDA-graph
capture; callers fall back to the Triton kernel when it does not.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BLOCK = 128
#: Alignment of the weight scales' row stride cuBLAS asks for, in float32 elements (16 bytes).
SCALE_ALIGN = 4
#: Row counts tried by the probe: a single token, an odd count, a full tile.
PROBE_ROWS = (1, 3, 16)
PROBE_TOLERANCE = 1e-2


def scaled_mm_linear(quantized: torch.Tensor, act_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] = (quantized [M, K] * act_scale) @ (weight [N, K] * scale_inv)^T, block-scaled by cuBLAS."""
    rows = quantized.shape[0]
    padded_rows = -(-rows // SCALE_ALIGN) * SCALE_ALIGN
    if padded_rows != rows:  # outer-dim-major scale_a has row stride M: keep it 16-byte aligned
        quantized = F.pad(quantized.view(torch.uint8), (0, 0, 0, padded_rows - rows)).view(quantized.dtype)
        act_scale = F.pad(act_scale, (0, 0, 0, padded_rows - rows), value=1.0)
    k_blocks = scale_inv.shape[1]
    aligned = torch.ones(scale_inv.shape[0], -(-k_blocks // SCALE_ALIGN) * SCALE_ALIGN, dtype=torch.float32, device=scale_inv.device)
    aligned[:, :k_blocks] = scale_inv
    scale_b = aligned[:, :k_blocks].t()
    scale_a = act_scale.t().contiguous().t()
    out = torch._scaled_mm(quantized, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[:rows]


@functools.cache
def blockwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether block-scaled `torch._scaled_mm` runs and is right on `device` (tried once, not during capture)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the block-scaled torch._scaled_mm check cannot run during CUDA-graph capture: call "
                           "fxfuse.models.quant.scaled_mm.blockwise_scaled_mm_works(device) before capturing")
    from fxfuse.models.fp8 import quantize_blocks
    from fxfuse.models.quant.reference import dequantize_activations, quantize_activations

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=generator)
    fp8_weight, scale_inv = quantize_blocks(weight, (BLOCK, BLOCK))
    dequantized = fp8_weight.float() * scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    try:
        for rows in PROBE_ROWS:
            x = torch.randn(rows, 384, generator=generator)
            quantized, act_scale = quantize_activations(x, BLOCK)
            expected = dequantize_activations(quantized, act_scale, BLOCK) @ dequantized.t()
            got = scaled_mm_linear(quantized.to(device), act_scale.to(device), fp8_weight.to(device), scale_inv.to(device),
                                   torch.float32).cpu()
            error = float((got - expected).norm() / expected.norm())
            if not error < PROBE_TOLERANCE:
                logger.warning("block-scaled torch._scaled_mm is wrong here (relative error %.3g): using Triton", error)
                return False
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        logger.info("block-scaled torch._scaled_mm unavailable here (%s): using Triton", str(exc).splitlines()[0])
        return False
    return True
