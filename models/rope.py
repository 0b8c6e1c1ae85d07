"""Rotary position embedding for MLA's rotary half: YaRN frequencies, cos/sin tables, rotation.

Numerically the same as transformers' DeepseekV3 rope: inverse frequencies from
`_compute_yarn_parameters` (or plain rope), cos/sin scaled by YaRN's attention factor and cast
to the activation dtype, and the rotation applied either to interleaved pairs (`rope_interleave`,
DeepSeek's checkpoint layout) or to the two halves. Both write the rotated vector as
[first-of-pair..., second-of-pair...], the layout transformers produces; queries and cached keys
use the same layout, so their dot products are the model's.
"""

from __future__ import annotations

import math

import torch

from fxfuse.models.config import ModelConfig, YarnScaling


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [qk_rope_head_dim // 2] rotation frequencies, YaRN-corrected when configured."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    base_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / base_freqs
    yarn = config.rope_scaling
    if yarn is None:
        return extrapolated
    interpolated = 1.0 / (yarn.factor * base_freqs)
    low, high = _yarn_correction_range(yarn, dim, base)
    extrapolation_weight = 1 - _linear_ramp(low, high, dim // 2)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def _yarn_correction_range(yarn: YarnScaling, dim: int, base: float) -> tuple[float, float]:
    """Rotary dimension range over which YaRN blends extrapolated into interpolated frequencies."""

    def dim_for_rotations(rotations: float) -> float:
        wavelength_ratio = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength_ratio) / (2 * math.log(base))

    low, high = dim_for_rotations(yarn.beta_fast), dim_for_rotations(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, size: int) -> torch.Tensor:
    """float32 [size]: 0 up to `low`, rising linearly to 1 at `high`."""
    if low == high:
        high += 0.001  # same guard as transformers: avoid dividing by zero
    ramp = (torch.arange(size, dtype=torch.float32) - low) / (high - low)
    return ramp.clamp(0, 1)


def cos_sin_tables(config: ModelConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin tables [num_positions, qk_rope_head_dim // 2] with YaRN's factor."""
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inverse_frequencies(config)[None, :]
    factor = config.rope_scaling.cos_sin_factor() if config.rope_scaling else 1.0
    return angles.cos() * factor, angles.sin() * factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dimension of `x` by the angles whose cos/sin broadcast against x[..., :d/2]."""
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
