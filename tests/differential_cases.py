"""Seeded random programs around the all-reduce -> residual add -> RMSNorm chain, as Python source.

`random_case(seed)` draws a `Case`: an activation dtype and shape, dynamic shapes or not, the inner
compilers to try, and one to three `Layer`s, each an all-reduce spelling (functional, in place, through
reshapes or a transpose, merged partial sums on one group or two, a max), a residual add spelling
(either order, `alpha`, sub, in place, broadcast, a scalar, an fp32 residual, the all-reduced tensor
itself), an RMSNorm spelling (upcasts, squares, means incl. float64 and over tokens, eps as 0, a float,
a tensor, with `alpha`, computed late or from the sum, every inverse square root, a 16-bit value times
a float32 inverse root, weight orders and dtypes, `F.rms_norm`, Gemma's `1 + w`, a norm cast to the
activations' dtype (a float32 residual stream's), a weight computed from the sum) and extra uses of intermediates or another
collective issued in between. `render(case)` writes it as a function `program(...)` (plain eager code:
the reproduction printed for a failing case) and the inputs it takes; `make_inputs` builds them, per
rank. `simpler(case)` lists smaller cases (a layer dropped, one choice set back to the plain spelling),
which the differential test uses to shrink a failing case.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Every choice of a layer with its weight in the draw (the plain spelling is `Layer`'s default).
LAYER_CHOICES: dict[str, list[tuple[str, int]]] = {
    "reduce": [("funcol", 8), ("inplace", 3), ("flat_view", 2), ("view3d", 2), ("unsqueeze", 1), ("transpose", 1),
               ("merge", 5), ("merge_views", 2), ("merge_other_group", 1), ("merge_alpha", 1), ("merge3", 2),
               ("max", 1)],
    "residual": [("after", 6), ("before", 6), ("none", 3), ("alpha_after", 1), ("alpha_before", 1), ("sub_after", 1),
                 ("sub_before", 1), ("inplace", 2), ("inplace_alpha", 1), ("scalar", 1)],
    "residual_source": [("input", 8), ("fp32", 1), ("broadcast", 1), ("alias", 1), ("alias_view", 1)],
    "upcast": [("float", 6), ("to", 2), ("none", 2)],
    "square": [("pow", 4), ("mul", 2), ("starstar", 1), ("square", 1)],
    "mean": [("last", 6), ("index", 2), ("torch", 1), ("float64", 1), ("tokens", 1)],
    "eps": [("1e-06", 4), ("0.0", 1), ("1e-05", 1), ("0.5", 1), ("first", 1), ("tensor", 1), ("late", 1),
            ("alpha", 1), ("from_sum", 1)],
    "inverse": [("rsqrt", 5), ("one_over_sqrt", 1), ("power", 1), ("reciprocal", 1), ("divide", 1)],
    "product": [("c_inv", 3), ("inv_c", 1), ("promoted", 1)],
    "weighting": [("cast_then_weight", 4), ("weight_left", 2), ("type_as", 1), ("weight_in_fp32", 1),
                  ("weight_in_fp32_left", 1), ("functional", 2), ("gemma", 1), ("weight_cast_first", 1),
                  ("to_activation", 1), ("none", 1)],
    "weight": [("input", 8), ("fp32", 1), ("alias", 1), ("from_sum", 1)],
    "extra": [("none", 8), ("reduced", 1), ("variance", 1), ("inverse", 1), ("collective", 1), ("collective_other", 1)],
}
#: Choices that only make sense in the first layer (they name the program's first input); later layers
#: take the previous layer's sum as their residual.
FIRST_LAYER_ONLY = {("residual_source", "alias"), ("residual_source", "alias_view"), ("weight", "alias")}


@dataclass(frozen=True)
class Layer:
    """One all-reduce site: how it reduces, adds the residual, normalizes (see `LAYER_CHOICES`)."""

    reduce: str = "funcol"
    residual: str = "after"
    residual_source: str = "input"
    upcast: str = "float"
    square: str = "pow"
    mean: str = "last"
    eps: str = "1e-06"
    inverse: str = "rsqrt"
    product: str = "c_inv"
    weighting: str = "cast_then_weight"
    weight: str = "input"
    extra: str = "none"


#: The plain layer: transformers' RMSNorm after `funcol.all_reduce(x) + residual`.
PLAIN = Layer()


@dataclass(frozen=True)
class Case:
    """A drawn program: activation dtype, shape, dynamic shapes, inner compilers, layers."""

    seed: int
    dtype: str = "float32"
    shape: tuple[int, ...] = (4, 16)
    dynamic: bool = False
    inners: tuple[str, ...] = ("eager",)
    layers: tuple[Layer, ...] = (Layer(),)

    @property
    def aliasing(self) -> bool:
        """Whether the residual or the weight is (a view of) the all-reduced input."""
        return any(layer.residual_source.startswith("alias") or layer.weight == "alias" for layer in self.layers)


def _draw(rng: random.Random, choices: list[tuple[str, int]]) -> str:
    names, weights = zip(*choices)
    return rng.choices(names, weights)[0]


#: The chance that a layer's choice is the plain spelling rather than a draw from all of them (so that
#: most layers stay fusible and the variations are tried one or two at a time).
PLAIN_SHARE = 0.75


def random_case(seed: int, inductor_share: float = 0.0) -> Case:
    """The case of `seed`; with probability `inductor_share` it is also compiled with Inductor."""
    rng = random.Random(seed)
    layers = []
    for index in range(rng.choice((1, 1, 2, 2, 3))):
        fields = {}
        for name, choices in LAYER_CHOICES.items():
            allowed = [c for c in choices if index == 0 or (name, c[0]) not in FIRST_LAYER_ONLY]
            plain = rng.random() < PLAIN_SHARE or (index > 0 and name == "residual_source")
            fields[name] = getattr(PLAIN, name) if plain else _draw(rng, allowed)
        layers.append(Layer(**fields))
    hidden = rng.choice((16, 32))
    shapes = [(4, hidden), (5, hidden), (2, 3, hidden), (1, hidden)]
    # a norm over one token is x / |x|: the rounding a merge changes (bfloat16 partial sums) can
    # flip its sign where x is near 0; over more tokens, as over the hidden size, it cannot
    shape = rng.choice(shapes[:2] if any(layer.mean == "tokens" for layer in layers) else shapes)
    inners = ("eager", "inductor") if rng.random() < inductor_share else ("eager",)
    return Case(seed, _draw(rng, [("float32", 4), ("bfloat16", 4), ("float16", 2)]), shape, rng.random() < 0.2,
                inners, tuple(layers))


def simpler(case: Case) -> list[Case]:
    """Cases one step simpler than `case`: a layer dropped, one choice of one layer set back to the plain
    spelling, static shapes, float32, two dimensions."""
    found = []
    for index in range(len(case.layers)):
        if len(case.layers) > 1:
            found.append(dataclasses.replace(case, layers=case.layers[:index] + case.layers[index + 1:]))
    for index, layer in enumerate(case.layers):
        for field in dataclasses.fields(Layer):
            if getattr(layer, field.name) != field.default:
                plain = dataclasses.replace(layer, **{field.name: field.default})
                found.append(dataclasses.replace(case, layers=case.layers[:index] + (plain,) + case.layers[index + 1:]))
    if case.dynamic:
        found.append(dataclasses.replace(case, dynamic=False))
    if case.dtype != "float32":
        found.append(dataclasses.replace(case, dtype="float32"))
    if len(case.shape) != 2:
        found.append(dataclasses.replace(case, shape=(4, case.shape[-1])))
    return found


# ---------------------------------------------------------------- source


@dataclass(frozen=True)
class Input:
    """A program input: name, shape, dtype name, and how its values are drawn ("activation", "matrix",
    "weight", "eps")."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str


class _Writer:
    """Accumulates a program's lines, inputs and outputs."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.lines: list[str] = []
        self.inputs: list[Input] = []
        self.outputs: list[str] = []

    def input(self, name: str, shape: tuple[int, ...], kind: str, dtype: str | None = None) -> str:
        self.inputs.append(Input(name, shape, dtype or self.case.dtype, kind))
        return name

    def line(self, text: str) -> None:
        self.lines.append("    " + text)


def render(case: Case) -> tuple[str, list[Input]]:
    """The source of `def program(<inputs>, *, g, g2)` for `case` (g, g2: two process groups of the same
    ranks) and its inputs, in order."""
    writer = _Writer(case)
    shape, hidden = case.shape, case.shape[-1]
    dims = len(shape)
    previous_n = previous_h = None
    for i, layer in enumerate(case.layers):
        if i == 0:
            partial = writer.input(f"x{i}", shape, "activation")
        else:
            writer.line(f"p{i} = {previous_n}.to({_dtype(case.dtype)}) @ {writer.input(f'm{i}', (hidden, hidden), 'matrix')}")
            partial = f"p{i}"
        reshape = _reduce(writer, layer, i, partial, dims)
        if layer.reduce == "unsqueeze" or (layer.reduce == "view3d" and dims == 2):
            dims += 1
        if layer.extra in ("collective", "collective_other"):
            group = "g" if layer.extra == "collective" else "g2"
            other = writer.input(f"z{i}", shape, "activation")
            writer.line(f"t{i} = funcol.all_reduce({other} * 2, 'sum', {group})")
            writer.outputs.append(f"t{i}")
        residual = previous_h if i > 0 else _first_residual(writer, layer, reshape, hidden)
        _residual_add(writer, layer, i, residual)
        _norm(writer, layer, i, hidden, dims)
        previous_n, previous_h = f"n{i}", f"h{i}"
    writer.outputs[:0] = [previous_n, previous_h]
    signature = ", ".join(item.name for item in writer.inputs)
    source = "\n".join([f"def program({signature}, *, g, g2):", *writer.lines,
                        f"    return ({', '.join(writer.outputs)},)"])
    return source, writer.inputs


def _dtype(name: str) -> str:
    return f"torch.{name}"


def _reduce(writer: _Writer, layer: Layer, i: int, partial: str, dims: int) -> str:
    """Write `s{i}`, the all-reduced partial sum; returns the reshape it applies after the all-reduce, as
    a format string of the reshaped value (".view(1, -1, {0}.shape[-1])": a 2-D sum viewed in 3-D)."""
    ar = "funcol.all_reduce({}, 'sum', g)".format

    def other_partial(name: str) -> str:
        if i == 0:
            return writer.input(f"x{name}{i}", writer.case.shape, "activation")
        hidden = writer.case.shape[-1]
        writer.line(f"q{name}{i} = n{i - 1}.to({_dtype(writer.case.dtype)}) @ "
                    f"{writer.input(f'm{name}{i}', (hidden, hidden), 'matrix')}")
        return f"q{name}{i}"

    reduce = layer.reduce
    reshape = {"view3d": ".view(1, -1, {0}.shape[-1])" if dims == 2 else "", "unsqueeze": ".unsqueeze(0)"}.get(reduce, "")
    if reduce in ("funcol", "view3d", "unsqueeze"):
        writer.line(f"s{i} = {ar(partial)}{reshape.format(partial)}")
    elif reduce == "inplace":
        writer.line(f"dist.all_reduce({partial}, group=g)")
        writer.line(f"s{i} = {partial}")
    elif reduce == "flat_view":
        writer.line(f"s{i} = {ar(f'{partial}.reshape(-1, {partial}.shape[-1])')}.view({partial}.shape)")
    elif reduce == "transpose":
        writer.line(f"s{i} = {ar(f'{partial}.transpose(0, -1).contiguous()')}.transpose(0, -1)")
    elif reduce == "max":
        writer.line(f"s{i} = funcol.all_reduce({partial}, 'max', g)")
    elif reduce in ("merge", "merge_other_group", "merge_alpha", "merge_views"):
        b = other_partial("b")
        group = "g2" if reduce == "merge_other_group" else "g"
        a_sum = ar(f"{partial}.reshape(-1, {partial}.shape[-1])") + f".view({partial}.shape)" if reduce == "merge_views" \
            else ar(partial)
        b_sum = f"funcol.all_reduce({b}, 'sum', {group})"
        writer.line(f"s{i} = torch.add({a_sum}, {b_sum}, alpha=2.0)" if reduce == "merge_alpha" else f"s{i} = {a_sum} + {b_sum}")
    elif reduce == "merge3":
        b, c = other_partial("b"), other_partial("c")
        writer.line(f"s{i} = {ar(partial)} + {ar(b)} + {ar(c)}")
    else:
        raise ValueError(reduce)
    return reshape


def _first_residual(writer: _Writer, layer: Layer, reshape: str, hidden: int) -> str:
    """The first layer's residual: an input (of the sum's shape, in float32, or a hidden-size vector), or
    the first input itself (reshaped as the sum was)."""
    source = layer.residual_source
    if source == "broadcast":
        return writer.input("r0", (hidden,), "activation")
    if source in ("input", "fp32"):
        name = writer.input("r0", writer.case.shape, "activation", "float32" if source == "fp32" else None)
        return name + reshape.format(name)
    base = "x0" if source == "alias" else "x0.view(x0.shape)"
    return base + reshape.format("x0")


def _residual_add(writer: _Writer, layer: Layer, i: int, r: str) -> None:
    s = f"s{i}"
    spelled = {
        "after": f"{s} + {r}", "before": f"{r} + {s}", "none": s, "scalar": f"{s} + 1.0",
        "alpha_after": f"torch.add({s}, {r}, alpha=2.0)", "alpha_before": f"torch.add({r}, {s}, alpha=0.5)",
        "sub_after": f"{s} - {r}", "sub_before": f"{r} - {s}",
    }
    if layer.residual in spelled:
        writer.line(f"h{i} = {spelled[layer.residual]}")
        return
    # a residual of fewer dimensions than the sum (a [hidden] vector, or the sum unsqueezed) takes its shape first
    broadcast = (i == 0 and layer.residual_source == "broadcast") or layer.reduce in ("unsqueeze", "view3d")
    writer.line(f"k{i} = {r}{f'.expand_as({s})' if broadcast else ''} * 1")  # an intermediate to add into
    writer.line(f"k{i}.add_({s}, alpha=2.0)" if layer.residual == "inplace_alpha" else f"k{i}.add_({s})")
    writer.line(f"h{i} = k{i}")


def _norm(writer: _Writer, layer: Layer, i: int, hidden: int, dims: int) -> None:
    """Write `n{i}`, an RMSNorm of `h{i}` (and its intermediates)."""
    h = f"h{i}"
    weight = _weight(writer, layer, i, hidden, dims) if layer.weighting != "none" else None
    if layer.weighting == "functional":
        value = layer.eps if layer.eps in ("1e-06", "0.0", "1e-05", "0.5") else "1e-06"
        writer.line(f"n{i} = F.rms_norm({h}, ({h}.shape[-1],), {weight}, {value})")
        return
    eps = _eps(writer, layer, i)
    writer.line(f"c{i} = " + {"float": f"{h}.float()", "to": f"{h}.to(torch.float32)", "none": h}[layer.upcast])
    c = f"c{i}"
    square = {"pow": f"{c}.pow(2)", "mul": f"({c} * {c})", "starstar": f"({c} ** 2)", "square": f"{c}.square()"}[layer.square]
    mean = {"last": f"{square}.mean(-1, keepdim=True)", "index": f"{square}.mean({dims - 1}, keepdim=True)",
            "torch": f"torch.mean({square}, dim=-1, keepdim=True)",
            "float64": f"{square}.mean(-1, keepdim=True, dtype=torch.float64)",
            "tokens": f"{square}.mean(-2, keepdim=True)"}[layer.mean]
    writer.line(f"v{i} = {mean}")
    v = f"v{i}"
    added = {"first": f"{eps} + {v}", "alpha": f"torch.add({v}, 0.5, alpha=4.0)"}.get(layer.eps, f"{v} + {eps}")
    writer.line(f"e{i} = {added}")
    e = f"e{i}"
    if layer.inverse == "divide":
        writer.line(f"i{i} = torch.sqrt({e})")
        normalized = f"({c} / i{i})"
    else:
        inverse = {"rsqrt": f"torch.rsqrt({e})", "one_over_sqrt": f"1 / torch.sqrt({e})", "power": f"{e} ** -0.5",
                   "reciprocal": f"torch.reciprocal(torch.sqrt({e}))"}[layer.inverse]
        writer.line(f"i{i} = {inverse}")
        normalized = {"c_inv": f"({c} * i{i})", "inv_c": f"(i{i} * {c})", "promoted": f"({h} * i{i})"}[layer.product]
    writer.line(f"n{i} = " + {
        "cast_then_weight": f"{normalized}.to({h}.dtype) * {weight}",
        "weight_left": f"{weight} * {normalized}.to({h}.dtype)",
        "type_as": f"{normalized}.type_as({h}) * {weight}",
        "weight_in_fp32": f"({normalized} * {weight}).to({h}.dtype)",
        "weight_in_fp32_left": f"({weight} * {normalized}).to({h}.dtype)",
        "gemma": f"({normalized} * (1.0 + {weight}.float())).type_as({h})",
        "weight_cast_first": f"({normalized} * {weight}.float()).to({h}.dtype)",
        "to_activation": f"({normalized} * {weight}).to({_dtype(writer.case.dtype)})",
        "none": f"{normalized}.to({h}.dtype)",
    }[layer.weighting])
    if layer.extra in ("reduced", "variance", "inverse"):
        writer.outputs.append({"reduced": f"s{i}", "variance": v, "inverse": f"i{i}"}[layer.extra])


def _weight(writer: _Writer, layer: Layer, i: int, hidden: int, dims: int) -> str:
    row = ", ".join(["0"] * (dims - 1))
    if layer.weight == "alias":
        return f"x0[{', '.join(['0'] * (len(writer.case.shape) - 1))}]"
    if layer.weight == "from_sum":
        return f"h{i}[{row}]"
    dtype = "float32" if layer.weight == "fp32" and layer.weighting != "functional" else None
    return writer.input(f"w{i}", (hidden,), "weight", dtype)


def _eps(writer: _Writer, layer: Layer, i: int) -> str:
    if layer.eps == "first":
        return "1e-06"
    if layer.eps in ("tensor", "late"):
        name = writer.input(f"eps{i}", (), "eps", "float32")
        return name if layer.eps == "tensor" else f"({name}.sum() * 0.5)"
    if layer.eps == "from_sum":
        return f"(h{i}.abs().mean() * 1e-3)"
    return layer.eps


def make_inputs(inputs: list[Input], seed: int, rank: int) -> list[torch.Tensor]:
    """The inputs of a rendered program for one rank (partial sums differ per rank)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    made = []
    for item in inputs:
        if item.kind == "eps":
            value = torch.tensor(1e-5)
        elif item.kind == "weight":
            value = 1 + 0.1 * torch.randn(item.shape, generator=gen)
        elif item.kind == "matrix":
            value = torch.randn(item.shape, generator=gen) / item.shape[0] ** 0.5
        else:
            value = torch.randn(item.shape, generator=gen)
        made.append(value.to(DTYPES[item.dtype]))
    return made
