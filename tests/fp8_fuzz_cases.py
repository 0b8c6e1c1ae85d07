"""Seeded random FP8 quantizations after a fused site, for the FP8 epilogue's differential test.

`random_case(seed)` draws one quantization of the normed output as serving code may write it: the
values (upcast before or after grouping, or left to type promotion), the grouping (a view keeping the
rows, `unflatten`, a reshape of the flattened rows, vLLM's zero padding to the group), the group maximum
(`amax`, `.max(dim)[0]`, `.max(dim).values`, of the 16-bit or the float32 values, keepdim or
unsqueezed), bounds on the maximum and on the scale (`clamp_min`, `clamp(min=)`), the scale's dtype,
power-of-two scales (`exp2` or `torch.pow(2.0, ...)`, the scale's bound before or after the rounding),
the divisor (448, `torch.finfo(...).max`, a module constant that `dynamic=True` makes a graph input), a
division or a reciprocal multiply, the clamp (none, both sides, either order, `torch.minimum` and
`torch.maximum` of tensors), static per-tensor scales, and what the graph reads afterwards (the values
viewed back, a slice of them, the normed output too). Some draws are wrong on purpose (a clamp from
+448, a clamp on one side where the cast does not saturate, another bound or divisor, a scale broadcast
across the columns, a per-tensor maximum, a maximum of values cast to another 16-bit dtype first, a pad
of a whole extra group, a scale replaced where the maximum is zero): `Fp8Case.folds` says whether the
pass must fold the case, and `Fp8Case.reasons` what it may say when not. `render(case)` writes the block
as Python source.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

#: What the search says when no recipe of the op gives the code's codes and scales on its probe rows.
NO_RECIPE = "no recipe of the fused op computes this quantization"
#: Substrings of the reason the pass must record for a draw it must not fold.
WRONG_CLAMPS = {"from_448": NO_RECIPE, "one_side": NO_RECIPE, "240": NO_RECIPE}
WRONG_SCALES = {"divisor_240": NO_RECIPE, "per_tensor": "dynamic per-tensor scaling", "columns": "read across the columns"}
WRONG_OTHER = {"lossy_maximum": NO_RECIPE, "whole_group_pad": NO_RECIPE, "zero_guard": NO_RECIPE}


def _cast_saturates() -> bool:
    """Whether the installed torch's cast to e4m3 saturates (2.13 on), as `fxfuse.op.fp8_recipe` says."""
    return float(torch.tensor(1e4).to(torch.float8_e4m3fn).float()) == 448.0


@dataclass(frozen=True)
class Fp8Case:
    """One drawn block: all-reduce, residual add, RMSNorm, then an FP8 quantization of the norm."""

    seed: int
    dtype: str
    tokens: int
    hidden: int
    dynamic: bool
    scaling: str  # group | row | static_mul | static_div
    group: int
    grouping: str  # keep_rows | unflatten | flat | padded
    upcast: str  # first | grouped | promotion
    maximum: str  # amax | max_getitem | max_values
    maximum_of: str  # float32 | activations
    keepdim: bool
    min_amax: str  # none | clamp_min | clamp
    scale_in_activation_dtype: bool
    divisor: str  # 448 | finfo | divisor_240
    min_scale: bool
    power_of_two: str  # none | ceil | floor | round
    apply: str  # divide | reciprocal | one_over
    clamp: str  # none | both | min_then_max | max_then_min | from_448 | one_side | 240
    wrong_scale: str  # none | per_tensor | columns
    reads_normed: bool
    slices: bool
    power_spelling: str = "exp2"  # exp2 | pow_scalar
    bound_after_rounding: bool = False  # the scale's bound after its power-of-two rounding (vLLM's UE8M0)
    fp8_max: str = "literal"  # literal | module_constant (a global float: a graph input under dynamic=True)
    clamp_spelling: str = "clamp"  # clamp | min_max_tensors
    other_wrong: str = "none"  # none | lossy_maximum | whole_group_pad | zero_guard

    @property
    def folds(self) -> bool:
        """Whether the pass must fold this quantization into the fused op."""
        return not self.reasons

    @property
    def reasons(self) -> list[str]:
        """Substrings of the reasons the pass may give for leaving the quantization out, one per wrong thing
        in the draw (the pass names the first it meets); empty: it must fold."""
        reasons = [WRONG_CLAMPS[self.clamp]] if self.clamp in WRONG_CLAMPS and not self._saturated_anyway else []
        if self.other_wrong != "none":
            reasons.append(WRONG_OTHER[self.other_wrong])
        if self.scaling in ("group", "row"):
            if self.wrong_scale != "none":
                reasons.append(WRONG_SCALES[self.wrong_scale])
            if self.wrong_scale == "per_tensor" and self.upcast == "promotion" and self.dtype != "float32":
                reasons.append("is not a float32 value")  # a 0-dim scale does not promote the 16-bit values
            if self.divisor == "divisor_240":
                reasons.append(WRONG_SCALES["divisor_240"])
            if self.dynamic and self.scaling == "group" and self.grouping == "flat":
                reasons.append("groups the flattened rows")
        return reasons

    @property
    def _saturated_anyway(self) -> bool:
        """A clamp from above only, where the values' own cast saturates below -448 as the clamp's other side
        would (torch 2.13 on): the same values as a clamp to +-448."""
        return self.clamp == "one_side" and _cast_saturates()


def random_case(seed: int) -> Fp8Case:
    """The case of `seed` (a mix of foldable and wrong-on-purpose draws, about one in four wrong)."""
    rng = random.Random(seed)
    dtype = rng.choice(["bfloat16", "bfloat16", "float16", "float32"])
    scaling = rng.choice(["group", "group", "row", "row", "static_mul", "static_div"])
    group = rng.choice([64, 128])
    grouping = rng.choice(["keep_rows", "unflatten", "flat", "padded"]) if scaling == "group" else "keep_rows"
    hidden = rng.choice([192, 320]) if grouping == "padded" and group == 128 else rng.choice([256, 512])
    sixteen_bit = dtype != "float32"
    scale_in_activation_dtype = sixteen_bit and scaling == "row" and rng.random() < 0.3
    wrong = rng.random() < 0.25
    case = Fp8Case(
        seed=seed, dtype=dtype, tokens=rng.choice([1, 3, 8]), hidden=hidden, dynamic=rng.random() < 0.4,
        scaling=scaling, group=group, grouping=grouping,
        upcast="first" if scale_in_activation_dtype else rng.choice(["first", "grouped", "promotion"]),
        maximum=rng.choice(["amax", "max_getitem", "max_values"]),
        maximum_of="activations" if scale_in_activation_dtype else rng.choice(["float32", "activations"]),
        keepdim=rng.random() < 0.5, min_amax=rng.choice(["none", "none", "clamp_min", "clamp"]),
        scale_in_activation_dtype=scale_in_activation_dtype, divisor=rng.choice(["448", "finfo"]),
        min_scale=rng.random() < 0.4,
        power_of_two="none" if scale_in_activation_dtype else rng.choice(["none", "none", "ceil", "floor", "round"]),
        apply=rng.choice(["divide", "divide", "reciprocal", "one_over"]),
        clamp=rng.choice(["none", "both", "both", "min_then_max", "max_then_min"]), wrong_scale="none",
        reads_normed=rng.random() < 0.3, slices=rng.random() < 0.2,
    )
    case = replace(case, power_spelling=rng.choice(["exp2", "pow_scalar"]),
                   bound_after_rounding=case.min_scale and case.power_of_two != "none" and rng.random() < 0.5,
                   fp8_max=rng.choice(["literal", "literal", "module_constant"]),
                   clamp_spelling=rng.choice(["clamp", "clamp", "min_max_tensors"]))
    if case.power_of_two in ("floor", "round") and case.clamp == "none":
        case = replace(case, clamp="both")  # values up to twice 448: the cast of the version at hand decides
    if wrong:
        kinds = ["clamp", "divisor", "per_tensor", "columns", "lossy_maximum", "whole_group_pad", "zero_guard"]
        kind = rng.choice(kinds if scaling in ("group", "row") else ["clamp"])
        if kind == "clamp":
            case = replace(case, clamp=rng.choice(list(WRONG_CLAMPS)))
        elif kind == "divisor":
            case = replace(case, divisor="divisor_240")
        elif kind == "per_tensor":
            case = replace(case, wrong_scale="per_tensor", scaling="row")
        elif kind == "columns":  # a [T] scale unsqueezed at 0 broadcasts across the columns when T == hidden
            case = replace(case, wrong_scale="columns", scaling="row", tokens=hidden, keepdim=False)
        elif kind == "whole_group_pad":  # `(0, g - h % g)` pads a whole group when the width is a multiple of it
            case = replace(case, other_wrong=kind, scaling="group", grouping="padded", hidden=rng.choice([256, 512]),
                           dynamic=False)
        elif kind == "zero_guard":  # without bounds an all-zero group's scale is 0: the code makes it 1
            case = replace(case, other_wrong=kind, min_amax="none", min_scale=False, bound_after_rounding=False)
        else:
            case = replace(case, other_wrong=kind, scale_in_activation_dtype=False,
                           upcast="first" if case.upcast == "promotion" else case.upcast)
    return case


def render(case: Fp8Case) -> str:
    """The block as Python source: `def program(x, residual, weight, scale, group_name)` returning the
    e4m3 values, the scales (dynamic scalings), the residual sum (and the normed output when read)."""
    lines = [
        "def program(x, residual, weight, scale, group_name):",
        "    hidden = funcol.all_reduce(x, 'sum', group_name) + residual",
        "    h = hidden.float()",
        "    n = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype)",
    ]
    body, outputs = _quantization(case)
    lines += ["    " + line for line in body]
    extra = ", n" if case.reads_normed else ""
    lines.append(f"    return {outputs}, hidden{extra}")
    return "\n".join(lines) + "\n"


def _quantization(case: Fp8Case) -> tuple[list[str], str]:
    """(source lines after `n`, the returned quantization outputs)."""
    lines = []
    if case.scaling in ("static_mul", "static_div"):
        operator = "*" if case.scaling == "static_mul" else "/"  # a 0-dim scale does not promote n: upcast first
        lines.append(f"v = n.float() {operator} scale")
        lines += _clamped(case, "v")
        lines.append("q = v.to(torch.float8_e4m3fn)")
        return lines, _sliced(case, "q")
    divisor = {"448": _fp8_max(case), "finfo": "torch.finfo(torch.float8_e4m3fn).max", "divisor_240": "240.0"}[case.divisor]
    grouped = _grouped(case, lines)
    absolute = f"{grouped}.abs()" if case.maximum_of == "activations" or case.upcast != "grouped" else f"{grouped}.float().abs()"
    if case.maximum_of == "float32" and case.upcast == "promotion":
        absolute = f"{grouped}.float().abs()"
    if case.other_wrong == "lossy_maximum":  # the maximum of values rounded to another 16-bit dtype
        other = "torch.float16" if case.dtype == "bfloat16" else "torch.bfloat16"
        absolute = f"{grouped}.to({other}).abs()"
    if case.wrong_scale == "per_tensor":
        lines.append(f"m = {absolute}.amax()")
    elif case.maximum == "amax":
        lines.append(f"m = {absolute}.amax(-1, keepdim={case.keepdim})")
    elif case.maximum == "max_getitem":
        lines.append(f"m = {absolute}.max(dim=-1, keepdim={case.keepdim})[0]")
    else:
        lines.append(f"m = {absolute}.max(-1, keepdim={case.keepdim}).values")
    if case.min_amax == "clamp_min":
        lines.append("m = m.clamp_min(1e-4)")
    elif case.min_amax == "clamp":
        lines.append("m = m.clamp(min=1e-10)")
    if not case.scale_in_activation_dtype:
        lines.append("m = m.float()")
    lines.append(f"s = m / {divisor}")
    bound = "s = s.clamp(min=1.0 / (448.0 * 512.0))"
    if case.min_scale and not case.bound_after_rounding:
        lines.append(bound)
    if case.power_of_two != "none":
        exponent = f"torch.{case.power_of_two}(torch.log2(s))"
        lines.append(f"s = torch.exp2({exponent})" if case.power_spelling == "exp2" else f"s = torch.pow(2.0, {exponent})")
    if case.min_scale and case.bound_after_rounding:
        lines.append(bound)
    if case.other_wrong == "zero_guard":  # a scale of 1 where the maximum is zero: no recipe does that
        lines.append("s = torch.where(s == 0, torch.ones_like(s), s)")
    if case.scale_in_activation_dtype:
        lines.append("s = s.to(torch.float32)")
    broadcast = "s" if case.keepdim or case.wrong_scale == "per_tensor" else \
        ("s.unsqueeze(0)" if case.wrong_scale == "columns" else "s.unsqueeze(-1)")
    values = _values(case, grouped)
    if case.apply == "divide":
        lines.append(f"v = {values} / {broadcast}")
    elif case.apply == "reciprocal":
        lines.append(f"v = {values} * {broadcast}.reciprocal()")
    else:
        lines.append(f"v = {values} * (1.0 / {broadcast})")
    lines += _clamped(case, "v")
    lines.append("q = v.to(torch.float8_e4m3fn)")
    lines.append(_view_back(case))
    return lines, f"{_sliced(case, 'q')}, s"


def _grouped(case: Fp8Case, lines: list[str]) -> str:
    """Write the grouping of the normed values; the name of the grouped value."""
    first = "n.float()" if case.upcast == "first" and not case.scale_in_activation_dtype else "n"
    if case.scaling == "row":
        lines.append(f"g = {first}")
    elif case.grouping == "keep_rows":
        lines.append(f"g = {first}.view(n.shape[0], -1, {case.group})")
    elif case.grouping == "unflatten":
        lines.append(f"g = {first}.unflatten(-1, (-1, {case.group}))")
    elif case.grouping == "flat":
        lines.append(f"g = {first}.reshape(-1, {case.group})")
    elif case.other_wrong == "whole_group_pad":  # one group too many where the width is a multiple of the group
        lines.append(f"g = F.pad({first}, (0, {case.group} - n.shape[-1] % {case.group})).view(n.shape[0], -1, {case.group})")
    else:  # vLLM: pad the rows to a multiple of the group, then a view of the groups
        lines.append(f"groups = (n.shape[-1] + {case.group - 1}) // {case.group}")
        lines.append(f"g = F.pad({first}, (0, groups * {case.group} - n.shape[-1])).view(-1, groups, {case.group})")
    return "g"


def _values(case: Fp8Case, grouped: str) -> str:
    """The values divided: grouped already float32, upcast now, or left to type promotion."""
    if case.upcast == "grouped" or (case.upcast == "first" and case.scale_in_activation_dtype):
        return f"{grouped}.float()"
    return grouped


def _fp8_max(case: Fp8Case) -> str:
    """448 as a literal, or as the module constant `FP8_MAX` (a graph input under dynamic=True)."""
    return "FP8_MAX" if case.fp8_max == "module_constant" else "448.0"


def _clamped(case: Fp8Case, name: str) -> list[str]:
    if case.clamp_spelling == "min_max_tensors" and case.clamp in ("both", "min_then_max", "max_then_min"):
        return [f"{name} = torch.maximum(torch.minimum({name}, {name}.new_tensor(448.0)), {name}.new_tensor(-448.0))"]
    if case.fp8_max == "module_constant" and case.clamp == "both":
        return [f"{name} = {name}.clamp(-FP8_MAX, FP8_MAX)"]
    return {"none": [], "both": [f"{name} = {name}.clamp(-448.0, 448.0)"],
            "min_then_max": [f"{name} = {name}.clamp_min(-448.0).clamp_max(448.0)"],
            "max_then_min": [f"{name} = {name}.clamp(max=448.0).clamp(min=-448.0)"],
            "from_448": [f"{name} = {name}.clamp(min=448.0)"],
            "one_side": [f"{name} = {name}.clamp(max=448.0)"],
            "240": [f"{name} = {name}.clamp(-240.0, 240.0)"]}[case.clamp]


def _view_back(case: Fp8Case) -> str:
    if case.scaling == "row":
        return "q = q.view(n.shape)"
    if case.grouping == "padded" or case.other_wrong == "whole_group_pad":
        return "q = q.view(n.shape[0], -1)[:, :n.shape[-1]]"
    return "q = q.view(n.shape)"


def _sliced(case: Fp8Case, name: str) -> str:
    return f"{name}[..., :64]" if case.slices else name
