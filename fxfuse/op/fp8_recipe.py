"""The FP8 quantization that may follow the fused op's RMSNorm, and its reference arithmetic.

In FP8 serving the normed activations go straight into an e4m3 quantization for the next GEMM. The
fusion pass (`fxfuse.passes.fp8_epilogue`) folds such a quantization into the fused op
(`fxfuse::allreduce_residual_rmsnorm_fp8`), described by an `Fp8Recipe` that records every choice the
unfused code's rounding depends on. With `x` the normed output upcast to float32 (exactly):
- `per_group` (per token and group of `group_size` consecutive values: DeepSeek-V3's block-FP8
  activations, group 128; a last, partial group is zero padding's) and `per_row` (the whole row, one
  group: torchao's PerRow, vLLM's per-token) compute a dynamic scale per group, in this order:
  1. `amax`, the maximum of |x| over the group (exact in any float dtype; NaN if a value is NaN);
  2. `max(amax, min_amax)` when `min_amax` > 0 (a lower bound on the maximum: DeepSeek's 1e-4,
     SGLang's eps; the bound as the graph's dtype rounds it);
  3. `amax / divisor` (448; the op's `scale_divisor` argument, a graph value when
     `torch.compile(dynamic=True)` made the constant one), rounded to `scale_dtype` (float32, or
     the activation dtype when the code never upcast: torchao);
  4. `max(scale, min_scale)` when `min_scale` > 0 (a lower bound on the scale itself: vLLM's
     1 / (448 * 512)), in `scale_dtype` (the bound rounded to it, as torch's clamp rounds it);
  5. `power_of_two`: `none`, or the scale rounded to a power of two, `2 ** ceil(log2(s))` (UE8M0
     scales of DeepSeek-V3.1 and vLLM), `floor` or `nearest` (`round`, half to even: torchao's
     e8m0), each step rounded to `scale_dtype`; with `bound_after_power_of_two`, step 4 comes after
     this one (vLLM's UE8M0 group quantization rounds first, then bounds); then the scale as float32;
  6. `x / scale`, or `x * (1 / scale)` when `reciprocal` (vLLM's `scale.reciprocal()`; the reciprocal
     rounded to float32 once);
  scales `[..., ceil(hidden / group_size)]` or `[..., 1]`.
- `static_mul` / `static_div`: one calibrated float32 scale tensor: `x * s` or `x / s`, no scales.
Then the values are clamped to +-448 when `saturate` (the code's clamp), else cast as torch casts them:
from torch 2.13 on its cast saturates to +-448 too, before it |v| > 464 becomes NaN ([448, 464] rounds
to 448 in both); `cast_saturates()` says which the installed torch does. The divisor of step 3 and the
clamp's bound are 448 unless the graph passes them in when it runs, and so may the bounds of steps 2
and 4 be (`bounds_from_graph`; `Fp8Limits` carries the values: under `torch.compile(dynamic=True)`
dynamo makes a module constant such as `torch.finfo(float8_e4m3fn).max` a graph input, and torch 2.15
computes `1 / (512 * FP8_MAX)` in the graph). `quantize_fp8` is the arithmetic every kernel reproduces (NaN where the unfused code has
NaN); on CPU it is the unfused torch code's, bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALINGS = ("per_group", "per_row", "static_mul", "static_div")
DYNAMIC_SCALINGS = ("per_group", "per_row")
POWER_OF_TWO_ROUNDINGS = ("none", "ceil", "floor", "nearest")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 quantization of the normed output (see the module docstring)."""

    scaling: str
    group_size: int = 0
    min_amax: float = 0.0
    scale_dtype: torch.dtype = torch.float32
    min_scale: float = 0.0
    power_of_two: str = "none"
    reciprocal: bool = False
    saturate: bool = True
    bound_after_power_of_two: bool = False
    bounds_from_graph: str = ""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling {self.scaling!r}: expected one of {', '.join(SCALINGS)}")
        if self.scaling == "per_group" and self.group_size < 1:
            raise ValueError(f"per_group FP8 scaling needs a positive group size, got {self.group_size}")
        if self.power_of_two not in POWER_OF_TWO_ROUNDINGS:
            raise ValueError(f"FP8 power-of-two rounding {self.power_of_two!r}: expected one of "
                             f"{', '.join(POWER_OF_TWO_ROUNDINGS)}")
        if not self.dynamic and (self.min_amax or self.min_scale or self.power_of_two != "none" or self.reciprocal):
            raise ValueError(f"{self.scaling} FP8 scaling takes no scale arithmetic (bounds, power of two, reciprocal)")
        for name in filter(None, self.bounds_from_graph.split(",")):
            if name not in GRAPH_BOUNDS or getattr(self, name) != GRAPH_BOUND_MARK:
                raise ValueError(f"bounds_from_graph {self.bounds_from_graph!r}: each of {', '.join(GRAPH_BOUNDS)} it names "
                                 f"must be {GRAPH_BOUND_MARK} in the recipe (its value comes with the call)")
        if self.bound_after_power_of_two and not (self.min_scale and self.power_of_two != "none"):
            raise ValueError("bound_after_power_of_two orders a lower bound on the scale after its power-of-two rounding: "
                             "the recipe needs both")

    @property
    def dynamic(self) -> bool:
        """Whether the scales are computed from the values (per group or row), not given."""
        return self.scaling in DYNAMIC_SCALINGS

    def groups(self, hidden):
        """Scales per row: ceil(hidden / group_size) for per_group (a last, partial group counts its
        values only, as zero padding does), 1 for per_row, 0 for static scalings."""
        if self.scaling == "per_group":
            return (hidden + self.group_size - 1) // self.group_size  # vLLM's spelling: one symbolic form under dynamic=True
        return 1 if self.scaling == "per_row" else 0

    def refusal(self, hidden) -> str | None:
        """Why the fused op cannot quantize rows of `hidden` values this way; None if it can (a symbolic
        `hidden` is checked when the op runs)."""
        if self.scaling == "per_group" and self.group_size & (self.group_size - 1):
            return f"the FP8 group size {self.group_size} is not a power of two"
        if self.dynamic and self.scale_dtype not in SCALE_DTYPES:
            return f"the FP8 scale is computed in {self.scale_dtype}"
        return None

    def describe(self) -> str:
        """The recipe in a few words, for reports: e.g. `per_group 128, scale >= 4.36e-06, power of two (ceil)`."""
        words = [self.scaling + (f" {self.group_size}" if self.scaling == "per_group" else "")]
        graph = self.bounds_from_graph.split(",")
        if self.min_amax:
            words.append("max >= a value of the graph" if "min_amax" in graph else f"max >= {self.min_amax:.3g}")
        if self.dynamic and self.scale_dtype != torch.float32:
            words.append(f"scale in {str(self.scale_dtype).removeprefix('torch.')}")
        bound = [("scale >= a value of the graph" if "min_scale" in graph else f"scale >= {self.min_scale:.3g}")] \
            if self.min_scale else []
        rounding = [f"power-of-two scale ({self.power_of_two})"] if self.power_of_two != "none" else []
        words += rounding + bound if self.bound_after_power_of_two else bound + rounding
        if self.reciprocal:
            words.append("times the scale's reciprocal")
        if not self.saturate:
            words.append("no clamp")
        return ", ".join(words)


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


#: Recipe fields whose value a call may bring (`Fp8Recipe.bounds_from_graph`), and what such a field holds.
GRAPH_BOUNDS = ("min_amax", "min_scale")
GRAPH_BOUND_MARK = 1.0


@dataclass(frozen=True)
class Fp8Limits:
    """The numbers of a quantization the graph may pass in when it runs: the divisor of the group maximum
    (step 3) and the bound of the values' clamp (+-`clamp`), both 448 in every spelling seen; and the lower
    bounds on the maximum and the scale where the recipe takes them from the graph (`bounds_from_graph`;
    None: the recipe's own). Each is a 0-dim CPU tensor of the graph where dynamo lifted a Python float to
    a graph input (or computed one from such an input: `1 / (512 * FP8_MAX)`)."""

    divisor: float = 448.0
    clamp: float = 448.0
    min_amax: float | None = None
    min_scale: float | None = None

    def bounds(self, recipe: "Fp8Recipe") -> tuple[float, float]:
        """(the lower bound on the maximum, the lower bound on the scale) a call of `recipe` uses; ValueError
        when the recipe takes one from the graph and the call gave none."""
        graph = recipe.bounds_from_graph.split(",")
        for name in GRAPH_BOUNDS:
            if name in graph and getattr(self, name) is None:
                raise ValueError(f"allreduce_residual_rmsnorm_fp8: the recipe takes {name} from the graph "
                                 f"({'amax_bound' if name == 'min_amax' else 'scale_bound'}), and the call gives none")
        return (self.min_amax if "min_amax" in graph else recipe.min_amax,
                self.min_scale if "min_scale" in graph else recipe.min_scale)


#: Values for compiling a kernel ahead of the first call (the kernel reads the call's own values as it runs).
WARM_UP_LIMITS = Fp8Limits(min_amax=GRAPH_BOUND_MARK, min_scale=GRAPH_BOUND_MARK)


@functools.cache
def cast_saturates() -> bool:
    """Whether the installed torch casts a float32 beyond e4m3's range to +-448 (torch >= 2.13) rather
    than to NaN."""
    return float(torch.tensor(1e4).to(FP8_DTYPE).float()) == FP8_MAX


@functools.cache
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """`value` as the nearest `dtype` number (a clamp bound as torch rounds it to the clamped tensor's dtype)."""
    return float(torch.tensor(value, dtype=dtype))


_POWER_OF_TWO_EXPONENT = {"ceil": torch.ceil, "floor": torch.floor, "nearest": torch.round}


def dynamic_scales(amax: torch.Tensor, recipe: Fp8Recipe, limits: Fp8Limits = Fp8Limits()) -> torch.Tensor:
    """Steps 2-5 of the module docstring: float32 scales from the group maxima `amax` (any float dtype)."""
    min_amax, min_scale = limits.bounds(recipe)
    amax = amax.float()
    if recipe.min_amax:
        amax = amax.clamp_min(min_amax)
    scale = amax.to(recipe.scale_dtype) / limits.divisor
    if recipe.min_scale and not recipe.bound_after_power_of_two:
        scale = scale.clamp_min(min_scale)
    if recipe.power_of_two != "none":
        scale = torch.exp2(_POWER_OF_TWO_EXPONENT[recipe.power_of_two](torch.log2(scale)))
    if recipe.bound_after_power_of_two:
        scale = scale.clamp_min(min_scale)
    return scale.float()


def quantize_fp8(normed: torch.Tensor, recipe: Fp8Recipe, static_scale: torch.Tensor | None = None,
                 limits: Fp8Limits = Fp8Limits()) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values shaped like `normed`, float32 scales of `scale_shape`) in the recipe's arithmetic,
    with the divisor and clamp bound of `limits` (448 unless the graph passes them in)."""
    x = normed.float()
    if not recipe.dynamic:
        scaled = x * static_scale if recipe.scaling == "static_mul" else x / static_scale
        return _to_fp8(scaled, recipe, limits.clamp), x.new_empty(0)
    grouped, maxima = group_maxima(normed, recipe)
    scale = dynamic_scales(maxima, recipe, limits)
    divided = grouped * scale.reciprocal().unsqueeze(-1) if recipe.reciprocal else grouped / scale.unsqueeze(-1)
    quantized = _to_fp8(divided, recipe, limits.clamp)
    hidden = normed.shape[-1]
    return quantized.view(*normed.shape[:-1], grouped.shape[-2] * grouped.shape[-1])[..., :hidden], scale


def group_maxima(normed: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values in float32 as `[..., groups, group]`, zero padded to whole groups; step 1, the maxima of
    |x| per group `[..., groups]`) of a dynamic recipe."""
    hidden = normed.shape[-1]
    size = recipe.group_size if recipe.scaling == "per_group" else hidden
    padding = (-hidden) % size  # a partial last group, zero padded (zeros change no maximum)
    grouped = torch.nn.functional.pad(normed.float(), (0, padding)).view(*normed.shape[:-1], (hidden + padding) // size, size)
    return grouped, grouped.abs().amax(-1)


def _to_fp8(scaled: torch.Tensor, recipe: Fp8Recipe, bound: float) -> torch.Tensor:
    return (scaled.clamp(-bound, bound) if recipe.saturate else scaled).to(FP8_DTYPE)
