"""DeepSeek-V3 block-FP8 weights: quantize, dequantize, and read one rank's slice dequantized.

A block-quantized weight `W` [out, in] is stored as `float8_e4m3fn` together with
`{name}_scale_inv` (float32) of shape [ceil(out / block_out), ceil(in / block_in)]; the real
weight is `W.float() * scale_inv[i // block_out, j // block_in]` (DeepSeek-V3
`inference/kernel.py` `weight_dequant`; the last block of a dimension may be partial). The block
size comes from config.json `quantization_config.weight_block_size` (128x128 for DeepSeek-V3).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
DEFAULT_BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"


def scale_name(weight_name: str) -> str:
    """Checkpoint name of the per-block inverse scales of FP8 tensor `weight_name`."""
    return weight_name + SCALE_SUFFIX


def block_size_from_config(config: Mapping[str, Any]) -> tuple[int, int]:
    """FP8 block size (rows, cols) from a config.json dict; DeepSeek's 128x128 when it names none."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size") or DEFAULT_BLOCK_SIZE
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale_inv grid for a 2-D weight: one scale per (possibly partial) block."""
    rows, cols = weight_shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight per block to (float8_e4m3fn weight, float32 scale_inv), as DeepSeek does.

    Each block's scale_inv is its max |value| / 448 (1 for an all-zero block), so the block's
    largest value maps to the largest finite FP8 value.
    """
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    padded = weight.new_zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = blocks / scale_inv[:, None, :, None]
    quantized = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(padded.shape)[:rows, :cols].contiguous()
    return quantized, scale_inv


def dequantize_window(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    row_start: int = 0,
    col_start: int = 0,
) -> torch.Tensor:
    """Float32 values of a window of an FP8 weight that starts at (row_start, col_start).

    `scale_inv` holds the scale rows/cols of the blocks covering the window, starting at block
    (row_start // block[0], col_start // block[1]); the window need not align to blocks.
    """
    rows, cols = weight.shape
    row_skip = row_start % block[0]
    col_skip = col_start % block[1]
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[row_skip : row_skip + rows]
    scales = scales.repeat_interleave(block[1], dim=1)[:, col_skip : col_skip + cols]
    return weight.float() * scales


def read_dequantized(source, name: str, slices: tuple[slice, slice], block: tuple[int, int], device: torch.device | str) -> torch.Tensor:
    """Float32 values of the part of FP8 tensor `name` selected by `slices` (2-D, unit step).

    Reads only that part of the weight and the scale rows/cols covering it from `source` (a
    `TensorSource`), and dequantizes on `device`.
    """
    rows, cols = (s.indices(n)[:2] for s, n in zip(slices, source.shape(name)))
    scale_slices = (
        slice(rows[0] // block[0], math.ceil(rows[1] / block[0])),
        slice(cols[0] // block[1], math.ceil(cols[1] / block[1])),
    )
    weight = source.read(name, slices).to(device)
    scale_inv = source.read(scale_name(name), scale_slices).to(device)
    return dequantize_window(weight, scale_inv, block, rows[0], cols[0])
