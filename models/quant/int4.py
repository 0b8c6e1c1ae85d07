"""INT4 group-quantized weights in compressed-tensors `pack-quantized` layout (Kimi-K2.5's routed experts).

A weight `W` [out, in] is stored as three tensors:
- `{name}_packed` int32 [out, ceil(in / 8)]: element j of a row sits in bits 4*(j % 8) .. 4*(j % 8) + 3
  of word j // 8 (least significant nibble first), as the unsigned value q + 8 for q in [-8, 7];
- `{name}_scale` [out, ceil(in / group)] (bf16 in Kimi-K2.5): one scale per group of `group` inputs;
- `{name}_shape` int32 [2]: (out, in).
The real weight is `q * scale[i, j // group]` (symmetric: no zero point). Here `name` is the
checkpoint's `...proj.weight`, so the tensors are `...proj.weight_packed` etc.
"""

from __future__ import annotations

import math

import torch

PACKED_SUFFIX, SCALE_SUFFIX, SHAPE_SUFFIX = "_packed", "_scale", "_shape"
VALUES_PER_WORD = 8
INT4_MIN, INT4_MAX = -8, 7


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-8, 7] of shape [..., in] into int32 [..., ceil(in / 8)], 8 per word."""
    if values.min() < INT4_MIN or values.max() > INT4_MAX:
        raise ValueError("INT4 values must lie in [-8, 7]")
    cols = values.shape[-1]
    words = math.ceil(cols / VALUES_PER_WORD)
    nibbles = torch.zeros(*values.shape[:-1], words * VALUES_PER_WORD, dtype=torch.int64, device=values.device)
    nibbles[..., :cols] = values.to(torch.int64) + 8
    nibbles = nibbles.view(*values.shape[:-1], words, VALUES_PER_WORD)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)
    packed = (nibbles << shifts).sum(dim=-1)  # < 2**32: reinterpret the low 32 bits as signed int32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int, first: int = 0) -> torch.Tensor:
    """int8 values [..., cols] of packed words [..., w], starting at element `first` of word 0."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    values = nibbles.reshape(*packed.shape[:-1], -1)[..., first : first + cols]
    return (values - 8).to(torch.int8)


def quantize_groups(weight: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 group quantization of weight [..., in]: (int8 values in [-8, 7], scales [..., in / group]).

    Each group's scale is its max |value| / 7 rounded to `scale_dtype` (1 for an all-zero group), so
    the largest value maps to +-7; `in` must be a multiple of `group`.
    """
    if weight.shape[-1] % group:
        raise ValueError(f"input dimension {weight.shape[-1]} is not a multiple of the group size {group}")
    groups = weight.float().reshape(*weight.shape[:-1], -1, group)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax)).to(scale_dtype)
    values = torch.round(groups / scale.float().unsqueeze(-1)).clamp(INT4_MIN, INT4_MAX)
    return values.reshape(weight.shape).to(torch.int8), scale


def dequantize_groups(values: torch.Tensor, scale: torch.Tensor, group: int, first: int = 0) -> torch.Tensor:
    """float32 weight [..., cols] from int values [..., cols] and the scales of the groups covering them.

    `scale[..., 0]` is the scale of the group that element `first` (of the full row) falls in.
    """
    cols = values.shape[-1]
    skip = first % group
    scales = scale.float().repeat_interleave(group, dim=-1)[..., skip : skip + cols]
    return values.float() * scales


def pack_checkpoint_tensors(name: str, weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """The three compressed-tensors checkpoint tensors of 2-D float `weight` saved as `name`."""
    values, scale = quantize_groups(weight, group)
    return {
        name + PACKED_SUFFIX: pack_int4(values),
        name + SCALE_SUFFIX: scale,
        name + SHAPE_SUFFIX: torch.tensor(weight.shape, dtype=torch.int32),
    }


def read_int4_window(
    source, name: str, shape: tuple[int, int], slices: tuple[slice, slice], group: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(int8 values, covering scales, first column) of the part of INT4 weight `name` (logical `shape`
    [out, in]) selected by `slices`.

    Reads from `source` (a `TensorSource`) only the packed words and scale columns that cover the
    window; the window's columns need not align to words or groups.
    """
    (r0, r1), (c0, c1) = (s.indices(n)[:2] for s, n in zip(slices, shape))
    packed = source.read(name + PACKED_SUFFIX, (slice(r0, r1), slice(c0 // VALUES_PER_WORD, math.ceil(c1 / VALUES_PER_WORD))))
    scale = source.read(name + SCALE_SUFFIX, (slice(r0, r1), slice(c0 // group, math.ceil(c1 / group))))
    return unpack_int4(packed, c1 - c0, c0 % VALUES_PER_WORD), scale, c0


def read_dequantized_int4(source, name: str, shape: tuple[int, int], slices: tuple[slice, slice], group: int, device) -> torch.Tensor:
    """float32 values of the part of INT4 weight `name` (logical `shape`) selected by `slices`, on `device`."""
    values, scale, first = read_int4_window(source, name, shape, slices, group)
    return dequantize_groups(values.to(device), scale.to(device), group, first)


def packed_shapes(shape: tuple[int, int], group: int) -> dict[str, tuple[int, ...]]:
    """Suffix -> checkpoint shape of the packed, scale and shape tensors of an INT4 weight [out, in]."""
    rows, cols = shape
    return {PACKED_SUFFIX: (rows, math.ceil(cols / VALUES_PER_WORD)), SCALE_SUFFIX: (rows, math.ceil(cols / group)), SHAPE_SUFFIX: (2,)}
