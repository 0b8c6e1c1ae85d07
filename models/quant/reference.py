"""The dequantizing reference of the quantized GEMMs (their CPU implementation), and activation quantization.

FP8 linear: y = x W^T with W dequantized per block (`weight.float() * scale_inv[i // bn, j // bk]`).
With FP8 activations ("w8a8") x is quantized per token and group of `bk` inputs by
`quantize_activations`, written in plain torch ops: the w8a8 dense linears call it from the model code,
so that under torch.compile it is part of the graph (models/quant/act_quant.py); the product of those
quantized activations, dequantized, with the weight is `fp8_linear_quantized_reference`.
`fp8_linear_reference` is both steps from unquantized x. Quantized experts: every expert dequantized
(FP8 blocks or INT4 groups), then the dense expert arithmetic of models/expert_math.py, their inputs
FP8-rounded the same way for "w8a8". Arithmetic in float32, result in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxfuse.models.expert_math import dense_experts
from fxfuse.models.fp8 import FP8_DTYPE, FP8_MAX
from fxfuse.models.quant.int4 import dequantize_groups, unpack_int4

#: Smallest group maximum the activation quantizer divides by (an all-zero group gets this scale).
MIN_ACTIVATION_AMAX = 1e-12


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization of x [M, K]: (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]).

    Each group's scale is its max |value| / 448, so x ~= q * scale with e4m3's 3 mantissa bits: a
    relative rounding error of at most 2**-4 per element (values far below the group maximum also
    lose bits to e4m3's subnormal range).
    """
    rows, cols = x.shape
    pad = (-cols) % group
    values = x.float()
    if pad:  # a ragged last group; DeepSeek-V3's widths are multiples of 128, so its graphs have no pad
        values = F.pad(values, (0, pad))
    grouped = values.view(rows, -1, group)
    amax = grouped.abs().amax(dim=-1).clamp_min(MIN_ACTIVATION_AMAX)
    scale = amax / FP8_MAX
    quantized = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, -1)
    return (quantized[:, :cols] if pad else quantized), scale


def dequantize_activations(quantized: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 x [M, K] from `quantize_activations`' output."""
    cols = quantized.shape[1]
    return quantized.float() * scale.repeat_interleave(group, dim=1)[:, :cols]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 values of FP8 weight [..., N, K] with block scales [..., ceil(N / bn), ceil(K / bk)]."""
    rows, cols = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return weight.float() * scales.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_int4_packed(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 values of packed INT4 weight [..., N, K / 8] with group scales [..., N, K / group]."""
    cols = scale.shape[-1] * group
    return dequantize_groups(unpack_int4(packed, cols), scale, group)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], gemm: str) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T -> [..., N] in x's dtype (activations FP8-rounded for "w8a8")."""
    flat = x.reshape(-1, x.shape[-1])
    if gemm == "w8a8":
        out = fp8_linear_quantized_reference(*quantize_activations(flat, block[1]), weight, scale_inv, block, x.dtype)
    else:
        out = (flat.float() @ dequantize_fp8_blocks(weight, scale_inv, block).t()).to(x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_quantized_reference(quantized: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """Per-token-group FP8 activations [M, K] (+ float32 scales [M, ceil(K / bk)], from `quantize_activations`)
    @ dequantized weight [N, K]^T -> [M, N] in `out_dtype`, both operands dequantized to float32."""
    out = dequantize_activations(quantized, scale, block[1]) @ dequantize_fp8_blocks(weight, scale_inv, block).t()
    return out.to(out_dtype)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: tuple[int, int]) -> torch.Tensor:
    """float32 [E, N, K] of stacked FP8 ("fp8", block scales) or packed INT4 ("int4", group block[1]) experts."""
    if fmt == "fp8":
        return dequantize_fp8_blocks(weight, scale, block)
    return dequantize_int4_packed(weight, scale, block[1])


def quant_experts_reference(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, stacked: list[tuple[torch.Tensor, torch.Tensor]],
    fmt: str, block: tuple[int, int], gemm: str,
) -> torch.Tensor:
    """Routed experts on dequantized weights ((gate, up, down) x (weight, scale)): [N, H] in x's dtype.

    With FP8 activations ("w8a8", FP8 experts) the expert inputs are FP8-rounded per token group first
    (the input of gate/up, and the input of down), as the GPU kernel does.
    """
    gate, up, down = (dequantize_experts(w, s, fmt, block) for w, s in stacked)
    if fmt == "fp8" and gemm == "w8a8":
        return _w8a8_experts(x, expert_ids, weights, gate, up, down, block[1])
    return dense_experts(x.float(), expert_ids, weights, gate, up, down).to(x.dtype)


def _w8a8_experts(x, expert_ids, weights, gate, up, down, group: int) -> torch.Tensor:
    """`dense_experts` with each GEMM's input FP8-rounded per token group (every expert sees the same x)."""
    rounded = dequantize_activations(*quantize_activations(x, group), group)
    combine = torch.zeros(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device).scatter(1, expert_ids, weights)
    hidden = F.silu(torch.einsum("nh,eih->eni", rounded, gate)) * torch.einsum("nh,eih->eni", rounded, up)
    hidden = hidden.to(x.dtype).float()  # the GPU path stores the expert hidden state in x's dtype
    hidden = torch.stack([dequantize_activations(*quantize_activations(h, group), group) for h in hidden])
    out = torch.einsum("eni,ehi->enh", hidden, down)
    return torch.einsum("enh,ne->nh", out, combine).to(x.dtype)
