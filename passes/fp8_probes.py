"""Probe rows that tell FP8 quantization recipes apart, and the values a quantization's parameters take.

`probe_rows(hidden, dtype, group_sizes, bounds)` builds rows of the norm's output (in its dtype) on which
any two different recipes of `fxfuse.op.fp8_recipe` give different codes or scales, and on which a
spelling that is no recipe at all shows it: random rows at many magnitudes (a division and a multiply by
the reciprocal round differently on some of their values; 16-bit rounding moves most rows' maxima), an
all-zero row and all-zero groups, -0.0, subnormal and smallest normal maxima, group maxima on both sides
of 448 times powers of two (where the power-of-two roundings and the bounds' order differ) and of 448
times odd powers of the square root of 2 (where rounding log2 to the nearest integer turns), maxima on
both sides of every bound the graph's constants could be (as a bound on the maximum and on the scale),
rows at the limits of the 16-bit formats, and rows with NaN and infinities. Each row has a label, for the
reasons the search gives. `parameter_draws(count)` gives the values a quantization's parameters (a static
scale, a divisor or bound the graph passes in) take in turn.
"""

from __future__ import annotations

import functools
import math

import torch

from fxfuse.op.fp8_recipe import rounded_to

#: Values each parameter of a quantization takes in turn (in every draw, different parameters differ).
PARAMETER_VALUES = (448.0, 0.37, 2.7, 1000.0, 2.0**-15)


def parameter_draws(count: int) -> list[tuple[float, ...]]:
    """Values for `count` parameters, one tuple per draw: every value for each, no two alike in a draw
    (unless there are more parameters than values); one draw (empty) without parameters."""
    if count == 0:
        return [()]
    return [tuple(PARAMETER_VALUES[(draw + index) % len(PARAMETER_VALUES)] for index in range(count))
            for draw in range(len(PARAMETER_VALUES))]


@functools.lru_cache(maxsize=64)
def probe_rows(hidden: int, dtype: torch.dtype, group_sizes: tuple[int, ...], bounds: tuple[float, ...]) -> tuple[torch.Tensor, tuple[str, ...]]:
    """([rows, hidden] tensor of `dtype`, a label per row): the probes above (kept per arguments: do not write to
    them); `group_sizes` are the group sizes the recipes may have (the maxima are set per group of the
    smallest), `bounds` the positive constants a recipe may bound the maximum or the scale by."""
    generator = torch.Generator().manual_seed(20261205)
    group = max(1, min([g for g in group_sizes if 0 < g <= hidden], default=hidden))
    info = torch.finfo(dtype)
    rows: list[torch.Tensor] = []
    labels: list[str] = []

    def add(row: torch.Tensor, label: str) -> None:
        rows.append(row.to(torch.float64))
        labels.append(label)

    def random_row(magnitude: float) -> torch.Tensor:
        return torch.randn(hidden, generator=generator, dtype=torch.float64) * magnitude

    def with_group_maxima(maximum: float) -> torch.Tensor:
        """A random row whose every group (of the smallest size) has the maximum |value| `maximum`, at a random
        place and sign; the other values below it."""
        row = (torch.rand(hidden, generator=generator, dtype=torch.float64) * 1.8 - 0.9) * maximum
        starts = torch.arange(0, hidden, group)
        widths = (hidden - starts).clamp(max=group)
        places = starts + (torch.rand(len(starts), generator=generator, dtype=torch.float64) * widths).long()
        signs = torch.where(torch.rand(len(starts), generator=generator) < 0.5, 1.0, -1.0).double()
        row[places] = signs * maximum
        return row

    def rounded(value: float) -> float | None:
        """`value` as the dtype rounds it, if positive and finite there."""
        if not (value > 0 and math.isfinite(value)) or value > info.max:
            return None
        here = rounded_to(value, dtype)
        return here if 0 < here <= info.max else None

    def with_neighbours(value: float) -> list[float]:
        """`value` rounded to the dtype and its two neighbours there (positive, finite)."""
        here = rounded(value)
        if here is None:
            return []
        here_t = torch.tensor(here, dtype=dtype)
        neighbours = [float(torch.nextafter(here_t, torch.tensor(limit, dtype=dtype))) for limit in (0.0, math.inf)]
        return [v for v in (neighbours[0], here, neighbours[1]) if 0 < v <= info.max]

    for magnitude in (1.0, 0.01, 100.0, 3.7, 0.05, min(1000.0, info.max / 8), 1e-3, 30.0):
        add(random_row(magnitude), f"random values of magnitude {magnitude:g}")
    add(with_group_maxima(448.0 * 3), "group maxima 3 * 448 (a scale of 3)")
    def with_values(values: list[float], maximum: float | None = None) -> torch.Tensor:
        """A row of `values` (repeated), every group's maximum |value| `maximum` (the values' own if None)."""
        row = with_group_maxima(maximum if maximum is not None else max(abs(v) for v in values))
        keep = row.abs() == row.abs().max()
        filler = torch.tensor(values, dtype=torch.float64).repeat(hidden // len(values) + 1)[:hidden]
        return torch.where(keep, row, filler)

    for scale_dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(scale_dtype).removeprefix("torch.")
        for maximum in (1.078125, 3.0625, 1.42578125, 22.5):  # a scale A / 448 of these has such values in every dtype
            scale = float((torch.tensor(maximum).to(dtype).to(scale_dtype) / 448.0).to(scale_dtype))
            values = _tie_values(dtype, scale)
            if values:
                add(with_values(values, float(torch.tensor(maximum).to(dtype))),
                    f"group maxima {maximum!r}, values whose quotient by the {name} scale rounds to e4m3 differently "
                    "when multiplied by the reciprocal")
                break
        for bound in sorted({b for b in bounds if b > 0 and math.isfinite(b)}):
            below = 448.0 * 2.0 ** math.floor(math.log2(bound))  # a maximum that binds either order of bound and rounding
            for scale, role in ((rounded_to(bound, scale_dtype), "the scale's bound"),
                                (rounded_to(rounded_to(bound, dtype) / 448.0, scale_dtype), "the maximum's bound / 448")):
                values = [v for v in _tie_values(dtype, scale) if abs(v) < below] if scale > 0 else []
                if values:
                    add(with_values(values), f"values whose quotient by {role} {bound:g} ({name}) rounds to e4m3 "
                                             "differently when multiplied by the reciprocal")
    add(torch.zeros(hidden, dtype=torch.float64), "all zeros")
    for size in sorted(set(group_sizes)):
        if 0 < size < hidden:
            row = random_row(1.0)
            row[:size] = 0.0
            add(row, f"a first group of {size} zeros")
    add(torch.full((hidden,), -0.0, dtype=torch.float64), "all -0.0")
    row = random_row(1.0)
    row[:group] = -0.0
    add(row, "a first group of -0.0")
    tiny = float(info.smallest_normal) * float(info.eps)  # the smallest subnormal
    add(with_group_maxima(tiny), "subnormal group maxima (the smallest)")
    add(with_group_maxima(tiny * 5), "subnormal group maxima")
    add(with_group_maxima(float(info.smallest_normal)), "smallest normal group maxima")
    for factor in (8.0, 100.0, 1792.0):  # scales below the smallest normal: their reciprocals overflow
        add(with_group_maxima(float(info.smallest_normal) * factor), f"group maxima {factor:g} times the smallest normal")
    for exponent in (-24, -9, -1, 0, 3):
        for maximum in with_neighbours(448.0 * 2.0 ** exponent):
            add(with_group_maxima(maximum), f"group maxima {maximum!r} (448 * 2**{exponent} and its neighbours)")
    for exponent in (-9.5, -0.5, 2.5):  # where rounding log2 to the nearest integer turns, as rounded in each dtype
        for step in (-3, -1, 0, 1, 3):
            maximum = rounded(448.0 * 2.0**exponent * (1 + step * 2.0**-9))
            if maximum is not None:
                add(with_group_maxima(maximum), f"group maxima {maximum!r} (near 448 * 2**{exponent})")
    for bound in sorted({b for b in bounds if b > 0 and math.isfinite(b)}):
        for target, what in ((bound, "the bound"), (bound * 448.0, "448 times the bound")):
            maxima = with_neighbours(target) + [v for v in (rounded(target / 2), rounded(target * 2)) if v is not None]
            for maximum in maxima:
                add(with_group_maxima(maximum), f"group maxima {maximum!r} (near {what} {bound:g})")
    for value in (65504.0, 1e5, 1e-8, 6.1e-5):
        if value <= info.max:
            add(with_group_maxima(value), f"group maxima {value:g} (a limit of the 16-bit formats)")
    for special, label in ((math.nan, "NaN"), (math.inf, "+inf"), (-math.inf, "-inf")):
        row = random_row(1.0)
        row[min(3, hidden - 1)] = special
        add(row, f"one {label} in the first group")
    return torch.stack(rows).to(dtype), tuple(labels)


def _tie_values(dtype: torch.dtype, scale: float, limit: int = 64) -> list[float]:
    """Up to `limit` values x of `dtype` (both signs) whose `x / scale` and `x * (1 / scale)` in float32 cast to
    different e4m3 codes (the two results straddle a tie of e4m3): a recipe's division and reciprocal
    multiply give different codes on them. Every finite value of a 16-bit dtype is tried (none: the two
    give the same codes for every 16-bit value); float32 values next to each tie times the scale."""
    divisor = torch.tensor(scale, dtype=torch.float32)
    if torch.finfo(dtype).bits == 16:
        values = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16).view(dtype)
        values = values.float()
    else:
        codes = torch.arange(0x40, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        centre = ((codes[:-1] + codes[1:]) / 2 * divisor).to(dtype)
        steps = [centre]
        for direction in (0.0, math.inf):
            value = centre
            for _ in range(2):
                value = torch.nextafter(value, torch.full_like(value, direction))
                steps.append(value)
        values = torch.cat(steps).float()
    differ = (values / divisor).to(torch.float8_e4m3fn).view(torch.uint8) != \
        (values * divisor.reciprocal()).to(torch.float8_e4m3fn).view(torch.uint8)
    found = values[differ & torch.isfinite(values / divisor) & (values != 0)]
    picked = found[torch.linspace(0, len(found) - 1, min(limit, len(found))).long()] if len(found) else found
    return [float(v) * sign for v in picked for sign in (1.0, -1.0)]
