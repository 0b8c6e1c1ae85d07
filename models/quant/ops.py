"""The quantized GEMMs as torch ops, so `torch.compile(fullgraph=True, dynamic=True)` traces them as
single nodes (fake kernels give their shapes) and CUDA graphs capture their kernels.

- `fxfuse_quant::fp8_linear(x, weight, scale_inv, block_n, block_k) -> y`: x [..., K] @ FP8 weight
  [N, K]^T with block scales, bf16 activations ("w8a16", models/quant/scheme.py).
- `fxfuse_quant::fp8_linear_quantized(x_q, x_scale, weight, scale_inv, block_n, block_k, out_dtype) -> y`:
  the same product with per-token-group FP8 activations ("w8a8") that the caller already quantized:
  x_q float8_e4m3fn [M, K], x_scale float32 [M, ceil(K / block_k)]. A w8a8 dense linear (models/layers.py)
  quantizes x outside any op (models/quant/act_quant.py `quantize_linear_input`: plain torch ops under
  torch.compile, so they sit in the graph right after the RMSNorm that produced x, where a compiler can
  fuse the two), then calls this op.
- `fxfuse_quant::quant_experts(x, expert_ids, weights, gate, gate_scale, up, up_scale, down, down_scale,
  fmt, block_n, block_k, gemm) -> y`: a rank's routed experts (SwiGLU) on FP8 ("fp8") or packed INT4
  ("int4", group = block_k) stacked weights, combined with the routing weights: [N, H]. With "w8a8" it
  quantizes the expert inputs itself (rows sorted per expert).
On CPU every op runs the dequantizing reference (models/quant/reference.py); on CUDA the Triton kernels of
models/quant/triton_gemm.py, and for `fp8_linear_quantized` with 128 x 128 blocks cuBLAS block-scaled
`torch._scaled_mm` where `models/quant/scaled_mm.py` found it working on this GPU. Every CUDA path has
fixed shapes for a given input shape and no host synchronization (capturable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxfuse.models.expert_math import combine_rows, sort_rows_by_expert
from fxfuse.models.quant import reference
from fxfuse.models.quant.act_quant import quantize_activations
from fxfuse.models.quant.triton_gemm import expert_tiles, quant_matmul, tile_shape


@torch.library.custom_op("fxfuse_quant::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """x [..., K] @ dequantized FP8 weight [N, K]^T -> [..., N] in x's dtype (bf16 activations, "w8a16")."""
    block = (block_n, block_k)
    if x.device.type != "cuda":
        return reference.fp8_linear_reference(x, weight, scale_inv, block, "w8a16")
    flat = x.reshape(-1, x.shape[-1])
    return triton_fp8_linear(flat, None, weight, scale_inv, block, x.dtype).view(*x.shape[:-1], weight.shape[0])


@fp8_linear.register_fake
def _(x, weight, scale_inv, block_n, block_k):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fxfuse_quant::fp8_linear_quantized", mutates_args=())
def fp8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 activations x_q [M, K] with per-token-group float32 scales x_scale [M, ceil(K / block_k)] @ dequantized
    FP8 weight [N, K]^T -> [M, N] in `out_dtype`."""
    block = (block_n, block_k)
    if x_q.device.type != "cuda":
        return reference.fp8_linear_quantized_reference(x_q, x_scale, weight, scale_inv, block, out_dtype)
    from fxfuse.models.quant.scaled_mm import blockwise_scaled_mm_works, scaled_mm_linear

    if blockwise_scaled_mm_works(x_q.device) and block == (128, 128):
        return scaled_mm_linear(x_q, x_scale, weight, scale_inv, out_dtype)
    return triton_fp8_linear(x_q, x_scale, weight, scale_inv, block, out_dtype)


@fp8_linear_quantized.register_fake
def _(x_q, x_scale, weight, scale_inv, block_n, block_k, out_dtype):
    return x_q.new_empty(x_q.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("fxfuse_quant::quant_experts", mutates_args=())
def quant_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor, up_scale: torch.Tensor,
    down: torch.Tensor, down_scale: torch.Tensor, fmt: str, block_n: int, block_k: int, gemm: str,
) -> torch.Tensor:
    """Routed experts on quantized stacked weights: x [N, H], ids / fp32 weights [N, k] -> [N, H]."""
    block = (block_n, block_k)
    stacked = [(gate, gate_scale), (up, up_scale), (down, down_scale)]
    if x.device.type != "cuda":
        return reference.quant_experts_reference(x, expert_ids, weights, stacked, fmt, block, gemm)
    return triton_experts(x, expert_ids, weights, stacked, fmt, block, gemm)


@quant_experts.register_fake
def _(x, expert_ids, weights, gate, gate_scale, up, up_scale, down, down_scale, fmt, block_n, block_k, gemm):
    return torch.empty_like(x)


def triton_experts(x, expert_ids, weights, stacked, fmt: str, block: tuple[int, int], gemm: str) -> torch.Tensor:
    """Routed experts by the Triton kernel: rows sorted by expert, one tiled launch each for gate, up and
    down, then the weighted sum per token (the CUDA path of `quant_experts`; any device under the interpreter)."""
    (gate, gate_scale), (up, up_scale), (down, down_scale) = stacked
    order, token_of_row, rows_per_expert = sort_rows_by_expert(expert_ids, gate.shape[0])
    rows = order.shape[0]
    int4 = fmt == "int4"
    fp8_acts = fmt == "fp8" and gemm == "w8a8"
    experts_with_rows = min(gate.shape[0], rows)  # at most
    block_m, block_n = tile_shape(-(-rows // max(1, experts_with_rows)), fp8_acts)
    tiles = expert_tiles(rows_per_expert, rows, block_m)
    # tiles that can hold rows: one partial tile per expert with rows, at most
    busy_tiles = min(tiles[0].shape[0], -(-rows // block_m) + experts_with_rows)
    common = dict(int4=int4, scale_block=block, block_m=block_m, block_n=block_n, busy_tiles=busy_tiles)

    def gemm_rows(a, row_ids, weight, scale):
        a_scale = None
        if fp8_acts:
            a, a_scale = quantize_activations(a, block[1])
        out = torch.empty(rows, weight.shape[1], dtype=x.dtype, device=x.device)
        return quant_matmul(a.contiguous(), a_scale, weight, scale, row_ids, tiles, out, **common)

    token_rows = token_of_row.to(torch.int32)
    hidden = F.silu(gemm_rows(x, token_rows, gate, gate_scale)) * gemm_rows(x, token_rows, up, up_scale)
    out = gemm_rows(hidden, torch.arange(rows, device=x.device, dtype=torch.int32), down, down_scale)
    return combine_rows(out, order, token_of_row, weights, x.shape[0]).to(x.dtype)


def triton_fp8_linear(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ FP8 weight [N, K]^T -> [M, N] in `out_dtype` by the Triton kernel: activations in a float dtype
    (`a_scale` None, "w8a16") or FP8 with per-token-group float32 scales `a_scale` [M, ceil(K / bk)] ("w8a8")."""
    rows = a.shape[0]
    block_m, block_n = tile_shape(rows, a_scale is not None)
    out = torch.empty(rows, weight.shape[0], dtype=out_dtype, device=a.device)
    return quant_matmul(a.contiguous(), a_scale, weight, scale_inv, None, None, out, int4=False, scale_block=block,
                        block_m=block_m, block_n=block_n)
