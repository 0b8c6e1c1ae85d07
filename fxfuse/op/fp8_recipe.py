"""The FP8 quantization that may follow the fused op's RMSNorm, and its reference arithmetic.

In FP8 serving the normed activations go straight into an e4m3 quantization for the next GEMM. The
fusion pass (`fxfuse.passes.fp8_epilogue`) folds such a quantization into the fused op
(`fxfuse::allreduce_residual_rmsnorm_fp8`), described by an `Fp8Recipe` that records everything the
unfused code's rounding depends on:
- `per_group`: per token and group of `group_size` consecutive values (DeepSeek-V3's block-FP8
  activations, group 128; a last, partial group as zero padding makes it): `scale = max(amax(|x|), min_amax) / 448`, `q = e4m3(clamp(x / scale))`
  (clamped to +-448; the divisor 448 is the op's `scale_divisor` argument, a graph value when
  `torch.compile(dynamic=True)` made the constant one),
  scales `[..., hidden / group_size]`;
- `per_row`: the same over the whole row (torchao's dynamic PerRow), scales `[..., 1]`;
- `static_mul` / `static_div`: one calibrated float32 scale tensor: `q = e4m3(clamp(x * s))` or
  `e4m3(clamp(x / s))`, no scales returned.
`x` is the normed output upcast to float32. For the dynamic scalings `scale_dtype` is the dtype in
which `amax` and `amax / 448` are computed: float32 when the code upcast first (DeepSeek, this
project's models), the activation dtype when it did not (torchao computes the scale on the bf16
tensor, then casts it to float32). `min_amax` 0.0 means no clamp. `quantize_fp8` is the arithmetic
every kernel reproduces; on CPU it is bit-identical to the unfused torch code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALINGS = ("per_group", "per_row", "static_mul", "static_div")
DYNAMIC_SCALINGS = ("per_group", "per_row")


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 quantization of the normed output (see the module docstring)."""

    scaling: str
    group_size: int = 0
    min_amax: float = 0.0
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling {self.scaling!r}: expected one of {', '.join(SCALINGS)}")
        if self.scaling == "per_group" and self.group_size < 1:
            raise ValueError(f"per_group FP8 scaling needs a positive group size, got {self.group_size}")

    @property
    def dynamic(self) -> bool:
        """Whether the scales are computed from the values (per group or row), not given."""
        return self.scaling in DYNAMIC_SCALINGS

    def groups(self, hidden):
        """Scales per row: ceil(hidden / group_size) for per_group (a last, partial group counts its
        values only, as zero padding does), 1 for per_row, 0 for static scalings."""
        if self.scaling == "per_group":
            return -(-hidden // self.group_size)
        return 1 if self.scaling == "per_row" else 0

    def refusal(self, hidden) -> str | None:
        """Why the fused op cannot quantize rows of `hidden` values this way; None if it can (a symbolic
        `hidden` is checked when the op runs)."""
        if self.scaling == "per_group" and self.group_size & (self.group_size - 1):
            return f"the FP8 group size {self.group_size} is not a power of two"
        if self.dynamic and self.scale_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the FP8 scale is computed in {self.scale_dtype}"
        return None


def check_fp8_arguments(normed_shape: torch.Size, recipe: Fp8Recipe, static_scale: torch.Tensor | None,
                        device: torch.device | None = None) -> None:
    """Raise ValueError when the recipe does not fit rows of `normed_shape[-1]` values or the static
    scale is missing, extra, not one float32 value, or not on `device` (the activations')."""
    refusal = recipe.refusal(normed_shape[-1])
    if refusal is not None:
        raise ValueError(f"allreduce_residual_rmsnorm_fp8: {refusal}")
    if recipe.dynamic != (static_scale is None):
        raise ValueError(f"allreduce_residual_rmsnorm_fp8: {recipe.scaling} scaling takes "
                         f"{'no' if recipe.dynamic else 'a'} static scale tensor")
    if static_scale is not None and (static_scale.numel() != 1 or static_scale.dtype != torch.float32):
        raise ValueError("allreduce_residual_rmsnorm_fp8: the static scale must be one float32 value, got "
                         f"{static_scale.dtype} of shape {list(static_scale.shape)}")
    if static_scale is not None and device is not None and static_scale.device != device:
        raise ValueError(f"allreduce_residual_rmsnorm_fp8: the static scale is on {static_scale.device}, x on {device}")


def scale_shape(normed_shape: torch.Size, recipe: Fp8Recipe) -> list:
    """Shape of the scales output: [..., groups] for dynamic scalings, [0] for static ones."""
    return [*normed_shape[:-1], recipe.groups(normed_shape[-1])] if recipe.dynamic else [0]


def quantize_fp8(normed: torch.Tensor, recipe: Fp8Recipe, static_scale: torch.Tensor | None = None,
                 divisor: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values shaped like `normed`, float32 scales of `scale_shape`) in the recipe's arithmetic;
    a dynamic scale is `amax / divisor` (448, unless the graph divides by another value: under
    `torch.compile(dynamic=True)` dynamo passes a Python float such as 448 in as a graph input)."""
    x = normed.float()
    if not recipe.dynamic:
        scaled = x * static_scale if recipe.scaling == "static_mul" else x / static_scale
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x.new_empty(0)
    hidden = normed.shape[-1]
    size = recipe.group_size if recipe.scaling == "per_group" else hidden
    padding = (-hidden) % size  # a partial last group, zero padded (zeros change no maximum)
    grouped_shape = (*normed.shape[:-1], (hidden + padding) // size, size)
    source = x if recipe.scale_dtype == torch.float32 else normed.to(recipe.scale_dtype)
    amax = torch.nn.functional.pad(source, (0, padding)).view(grouped_shape).abs().amax(-1)
    if recipe.min_amax:
        amax = amax.clamp_min(recipe.min_amax)
    scale = (amax / divisor).float()
    grouped = torch.nn.functional.pad(x, (0, padding)).view(grouped_shape)
    quantized = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(*normed.shape[:-1], hidden + padding)[..., :hidden], scale
