"""Recognize an FP8 quantization of a fused site's normed output, by meaning rather than one op sequence.

`find_quantization(fused, normed)` walks back from the one `.to(float8_e4m3fn)` that reads the norm's
output (within a few ops) and describes what it computes as an `Fp8Recipe`
(`fxfuse.op.fp8_recipe`), or raises `NotFused` with the reason. Spellings that compute the same
values are one recipe; every choice that changes a rounding is a field of it:
- the values: `n.float()`, or `n` itself where type promotion upcasts it (a 16-bit value divided by
  or multiplied with a float32 scale: vLLM's per-group code), maybe reshaped to other rows (as a
  linear flattens its input), grouped by a view/reshape/unflatten of the last dimension
  (`[..., groups, group]` or `[rows * groups, group]`), maybe zero-padded to a multiple of the group
  first and sliced back to the width after;
- the group maximum: `amax(abs(v), -1)` or `max(abs(v), dim=-1)[0]` / `.values` (of the 16-bit or the
  float32 values: the same numbers), keepdim or unsqueezed;
- the scale: an optional lower bound on the maximum (`clamp_min`, `clamp(min=)`), the division by
  448 (`torch.finfo(float8_e4m3fn).max`, a graph input under `dynamic=True`) in float32 or in the
  activation dtype (torchao) with exact upcasts around it, an optional lower bound on the scale
  (vLLM's `.clamp(min=1 / (448 * 512))`), optional power-of-two rounding `exp2(ceil|floor|round(log2(s)))`
  (UE8M0 scales);
- the values scaled: `v / s` or `v * s.reciprocal()` / `v * (1 / s)` (its rounding differs: the
  recipe says which), the scale broadcast along the last dimension only;
- a clamp to exactly [-448, 448] (`clamp`, `clamp_min` + `clamp_max`, either order) or none;
- static per tensor: `v * s` or `v / s` with `s` one float32 value the site does not compute.
Every fact the rewrite relies on is checked here: bounds with their sign, broadcast axes, slice ends,
that the values a scale is computed over are the ones it divides, that the op's inputs exist before
the site and do not depend on its outputs, and that nothing outside the quantization reads its
intermediate values.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.fp8_recipe import FP8_DTYPE, FP8_MAX, Fp8Recipe, rounded_to
from fxfuse.passes.canonical_form import CAST, DIV, MUL, RECIPROCAL, VIEW, is_call, val

aten = torch.ops.aten
ABS = aten.abs.default
AMAX = aten.amax.default
MAX_DIM = aten.max.dim
CLAMP = aten.clamp.default
CLAMP_MIN = aten.clamp_min.default
CLAMP_MAX = aten.clamp_max.default
UNSQUEEZE = aten.unsqueeze.default
SQUEEZE_DIMS = aten.squeeze.dims
SYM_SIZE = aten.sym_size.int
PAD = aten.constant_pad_nd.default
SLICE = aten.slice.Tensor
LOG2, EXP2 = aten.log2.default, aten.exp2.default
EXPONENT_ROUNDINGS = {aten.ceil.default: "ceil", aten.floor.default: "floor", aten.round.default: "nearest"}
RESHAPES = (VIEW, aten.reshape.default, aten._unsafe_view.default)
ORDER_KEEPING = (*RESHAPES, UNSQUEEZE, aten.squeeze.dim, SQUEEZE_DIMS, aten.squeeze.default)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


class NotFused(Exception):
    """A quantization follows the norm but cannot be folded; the message says why."""


@dataclass
class Fp8Match:
    """A recognized quantization of one fused site's normed output."""

    recipe: Fp8Recipe
    quantized: torch.fx.Node  # the e4m3 value as the graph reads it (maybe a view back)
    scale: torch.fx.Node | None  # the float32 scale value the graph reads (dynamic scalings)
    static_scale: torch.fx.Node | None
    inner: set = field(default_factory=set)  # nodes only the quantization uses (erased after the rewrite)
    divisor: torch.fx.Node | None = None  # a 0-dim CPU tensor the dynamic scale divides by (None: 448)


def casts_to_fp8_soon(value: torch.fx.Node, depth: int = 8) -> bool:
    """Whether some node within `depth` uses of `value` converts to an FP8 dtype."""
    frontier = {value}
    for _ in range(depth):
        frontier = {user for node in frontier for user in node.users}
        if any(is_call(node, CAST) and node.args[1] in FP8_DTYPES for node in frontier):
            return True
    return False


def find_quantization(fused: torch.fx.Node, normed: torch.fx.Node) -> Fp8Match:
    """The quantization of `normed` (output 0 of the fused op `fused`); NotFused says why not."""
    casts = [node for node in _downstream(normed) if is_call(node, CAST) and node.args[1] in FP8_DTYPES]
    if len(casts) != 1:
        raise NotFused(f"the norm's output is cast to FP8 {len(casts)} times")
    final = casts[0]
    if final.args[1] != FP8_DTYPE:
        raise NotFused(f"the quantization casts to {final.args[1]}, not float8_e4m3fn")
    inner = {final}
    scaled, saturate = _clamps(final.args[0], inner)
    if val(scaled) is None or val(scaled).dtype != torch.float32:
        raise NotFused(f"`{scaled.name}` before the FP8 cast is not a float32 value")
    if is_call(scaled, DIV):
        numerator, denominator, factor = scaled.args[0], scaled.args[1], None
    elif is_call(scaled, MUL):
        numerator, denominator, factor = _multiplied(scaled, fused)
        inner.update(factor or ())
    else:
        raise NotFused(f"`{scaled.name}` ({op_name(scaled)}) before the FP8 cast is neither a division by a scale nor a "
                       "multiplication by one")
    inner.add(scaled)
    if isinstance(denominator, torch.fx.Node) and depends_on(denominator, fused):
        match = _dynamic(scaled, numerator, denominator, factor is not None, normed, final, inner)
    else:
        match = _static(scaled, numerator, denominator, normed, final, inner)
    match.recipe = Fp8Recipe(**{**match.recipe.__dict__, "saturate": saturate})
    _check_private(match, normed)
    return match


def _downstream(value: torch.fx.Node, depth: int = 10) -> list[torch.fx.Node]:
    seen, frontier = [], [value]
    for _ in range(depth):
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen += frontier
    return seen


def _clamps(node, inner: set) -> tuple:
    """(the value under clamps to exactly [-448, 448], whether there were any); NotFused for other bounds."""
    lower = upper = None
    while is_call(node, CLAMP) or is_call(node, CLAMP_MIN) or is_call(node, CLAMP_MAX):
        low, high = _bounds(node)
        for bound, expected in ((low, -FP8_MAX), (high, FP8_MAX)):
            if bound is not None and (not isinstance(bound, (int, float)) or float(bound) != expected):
                raise NotFused(f"`{node.name}` clamps to [{low}, {high}], not to [-448, 448] before the FP8 cast")
        lower, upper = lower if low is None else low, upper if high is None else high
        inner.add(node)
        node = node.args[0]
    if (lower is None) != (upper is None):
        raise NotFused(f"the values are clamped on one side only ([{lower}, {upper}]) before the FP8 cast")
    return node, lower is not None


def _bounds(clamp: torch.fx.Node) -> tuple:
    """(min, max) of a clamp, clamp_min or clamp_max node (None where it has none)."""
    if is_call(clamp, CLAMP_MIN):
        return clamp.args[1] if len(clamp.args) > 1 else clamp.kwargs.get("min"), None
    if is_call(clamp, CLAMP_MAX):
        return None, clamp.args[1] if len(clamp.args) > 1 else clamp.kwargs.get("max")
    arguments = list(clamp.args[1:3]) + [None] * (3 - len(clamp.args))
    return (arguments[0] if arguments[0] is not None else clamp.kwargs.get("min"),
            arguments[1] if arguments[1] is not None else clamp.kwargs.get("max"))


def _multiplied(product: torch.fx.Node, fused: torch.fx.Node) -> tuple:
    """(values, scale, the nodes of `1 / scale` or None) of `values * factor`: factor = 1 / scale computed
    from the site's values (`reciprocal(s)`, `1 / s`, `reciprocal(s) * 1.0`) makes a reciprocal multiply; a
    factor the site does not compute is a static scale."""
    for values, outer in (product.args, tuple(reversed(product.args))):
        factor = outer.args[0] if is_call(outer, MUL) and outer.args[1] == 1.0 else outer  # Python's 1.0 / s
        if not isinstance(factor, torch.fx.Node) or not depends_on(factor, fused):
            return values, outer, None
        if is_call(factor, RECIPROCAL):
            return values, factor.args[0], {outer, factor}
        if is_call(factor, DIV) and isinstance(factor.args[0], (int, float)) and float(factor.args[0]) == 1.0:
            return values, factor.args[1], {outer, factor}
    raise NotFused(f"`{product.name}` multiplies by `{product.args[1].name}`, which is neither a static scale nor the "
                   "reciprocal of one computed from the norm's output")


def _static(scaled: torch.fx.Node, numerator, scale, normed: torch.fx.Node, final: torch.fx.Node, inner: set) -> Fp8Match:
    """`v * s` or `v / s` with s one float32 value computed apart from the site."""
    if not isinstance(numerator, torch.fx.Node) or not _values_of(numerator, normed, scaled):
        raise NotFused(f"`{scaled.name}` scales `{getattr(numerator, 'name', numerator)}`, not the norm's output in float32")
    value = val(scale)
    if value is None or value.numel() != 1 or value.dtype != torch.float32:
        raise NotFused(f"the static FP8 scale `{getattr(scale, 'name', scale)}` is not one float32 value")
    if value.device != val(normed).device:
        raise NotFused(f"the static FP8 scale `{scale.name}` is on {value.device}, the activations on {val(normed).device}")
    recipe = Fp8Recipe("static_mul" if is_call(scaled, MUL) else "static_div")
    return Fp8Match(recipe, _view_back(final, inner, normed, padded=False), None, scale, inner)


def _dynamic(scaled: torch.fx.Node, numerator, denominator, reciprocal: bool, normed: torch.fx.Node, final: torch.fx.Node,
             inner: set) -> Fp8Match:
    """`grouped / scale` or `grouped * (1 / scale)`, scale a chain over the group maxima of the same values."""
    explicit_upcast = is_call(numerator, CAST) and numerator.args[1] == torch.float32
    if explicit_upcast:
        inner.add(numerator)
    x, group, padded = _ungrouped(numerator.args[0] if explicit_upcast else numerator, inner)
    if not _values_of(x, normed, scaled):
        raise NotFused(f"`{scaled.name}` divides `{getattr(numerator, 'name', numerator)}`, not the norm's output in float32")
    core = _strip(denominator, ORDER_KEEPING, inner)
    recipe_fields, maximum_of = _scale_chain(core, inner)
    expected = [*val(numerator).shape[:-1], 1]
    broadcast = val(denominator).shape
    if len(broadcast) != len(expected) or not all(statically_known_true(a == b) for a, b in zip(broadcast, expected)):
        raise NotFused(f"the FP8 scale `{denominator.name}` of shape {list(broadcast)} is not broadcast along the last "
                       f"dimension of the values {list(val(numerator).shape)}")
    source_x, source_group, source_padded = _ungrouped(_exact_upcast_source(maximum_of, inner), inner)
    if source_group != group or source_padded != padded or not _rows_of(_exact_upcast_source(source_x, inner), normed):
        raise NotFused(f"the FP8 scale of `{scaled.name}` is computed over other values than it scales")
    hidden = val(normed).shape[-1]
    size = group or hidden
    is_row = group is None or statically_known_true(size == hidden)
    recipe = Fp8Recipe("per_row" if is_row else "per_group", 0 if is_row else size, reciprocal=reciprocal,
                       **recipe_fields["recipe"])
    refusal = recipe.refusal(hidden)
    if refusal is not None:
        raise NotFused(refusal)
    return Fp8Match(recipe, _view_back(final, inner, normed, padded), core, None, inner, recipe_fields["divisor"])


def _scale_chain(core: torch.fx.Node, inner: set) -> tuple[dict, torch.fx.Node]:
    """({"recipe": the scale fields of Fp8Recipe, "divisor": a divisor node or None}, abs of the grouped
    values) of the float32 scale `core`, read back to the group maximum in the recipe's order."""
    if val(core).dtype != torch.float32:
        raise NotFused(f"the FP8 scale `{core.name}` is {val(core).dtype}, not float32")
    node, scale_dtype = core, torch.float32
    if is_call(node, CAST) and val(node.args[0]).dtype in (torch.bfloat16, torch.float16):
        inner.add(node)
        node = node.args[0]
        scale_dtype = val(node).dtype
    power_of_two = "none"
    if is_call(node, EXP2) and node.args[0].target in EXPONENT_ROUNDINGS and is_call(node.args[0].args[0], LOG2):
        rounding = node.args[0]
        power_of_two = EXPONENT_ROUNDINGS[rounding.target]
        inner.update({node, rounding, rounding.args[0]})
        node = rounding.args[0].args[0]
    min_scale, node = _lower_bound(node, inner, "scale")
    if not is_call(node, DIV) or val(node).dtype != scale_dtype:
        raise NotFused(f"the FP8 scale `{node.name}` ({op_name(node)}) is not the group maximum divided by 448 in "
                       f"{scale_dtype} (then bounded below and rounded to a power of two, in that order)")
    divisor = _scale_divisor(node, inner)
    inner.add(node)
    maximum = _strip_exact(node.args[0], inner)
    min_amax, maximum = _lower_bound(maximum, inner, "maximum")
    maximum = _strip_exact(maximum, inner)
    absolute = _group_maximum_of(maximum, inner)
    fields = {"min_amax": min_amax, "scale_dtype": scale_dtype, "min_scale": min_scale, "power_of_two": power_of_two}
    return {"recipe": fields, "divisor": divisor}, absolute


def _lower_bound(node: torch.fx.Node, inner: set, what: str) -> tuple[float, torch.fx.Node]:
    """(the constant lower bound of a clamp from below, as the dtype it clamps in rounds it, or 0.0; the
    value under it). A 16-bit clamp may read `clamp(v.float(), c).to(dtype)` (Inductor's decomposition):
    the same as clamping v in its dtype by c rounded to it."""
    downcast = None
    if is_call(node, CAST) and (is_call(node.args[0], CLAMP_MIN) or is_call(node.args[0], CLAMP)) and \
            val(_exact_upcast_source(node.args[0].args[0])).dtype == node.args[1]:
        downcast, node = node, node.args[0]
    if not (is_call(node, CLAMP_MIN) or is_call(node, CLAMP)):
        return 0.0, node
    low, high = _bounds(node)
    if high is not None or not isinstance(low, (int, float)) or float(low) <= 0.0:
        raise NotFused(f"`{node.name}` bounds the FP8 {what} otherwise than from below by a positive constant "
                       f"([{low}, {high}])")
    inner.update({node, downcast} - {None})
    if downcast is None:
        return rounded_to(float(low), val(node).dtype), node.args[0]
    return rounded_to(float(low), downcast.args[1]), _exact_upcast_source(node.args[0], inner)


def _group_maximum_of(node: torch.fx.Node, inner: set) -> torch.fx.Node:
    """The `abs(values)` whose maximum over the last dimension `node` is (`amax` or `max(dim)[0]`)."""
    if is_call(node, AMAX):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
        reduced = node.args[0]
    elif node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 and \
            is_call(node.args[0], MAX_DIM):
        dims = [node.args[0].args[1]]
        reduced = node.args[0].args[0]
        inner.add(node.args[0])
    else:
        raise NotFused(f"`{getattr(node, 'name', node)}` ({op_name(node)}) is not the maximum of absolute values")
    rank = val(reduced).dim()
    if not dims or len(dims) == rank and rank > 1:
        raise NotFused(f"`{node.name}` reduces over every dimension: one scale for the whole tensor (dynamic per-tensor "
                       "scaling) is not folded")
    if [d % rank for d in dims] != [rank - 1]:
        raise NotFused(f"`{node.name}` reduces over dimensions {list(dims)}, not the last one")
    if not is_call(reduced, ABS):
        raise NotFused(f"`{node.name}` is the maximum of `{reduced.name}` ({op_name(reduced)}), not of absolute values")
    inner.update({node, reduced})
    return reduced.args[0]


def _scale_divisor(division: torch.fx.Node, inner: set) -> torch.fx.Node | None:
    """What the group maximum is divided by: 448 (None), or a 0-dim CPU float tensor node (dynamo made the
    constant a graph input under `dynamic=True`: its value is read when the op runs)."""
    divisor = division.args[1]
    if isinstance(divisor, (int, float)):
        if float(divisor) != FP8_MAX:
            raise NotFused(f"the FP8 scale `{division.name}` divides the group maximum by {divisor}, not 448")
        return None
    if is_call(divisor, CAST) and divisor.args[1] == torch.float32 and len(divisor.users) == 1:
        inner.add(divisor)
        divisor = divisor.args[0]
    value = val(divisor)
    if value is None or value.dim() != 0 or value.device.type != "cpu" or not value.is_floating_point():
        raise NotFused(f"the FP8 scale `{division.name}` divides by `{getattr(divisor, 'name', divisor)}`, not by a constant")
    return divisor


def _values_of(x, normed: torch.fx.Node, scaled: torch.fx.Node) -> bool:
    """`x` holds the norm's output values (its rows, maybe reshaped) in float32 where `scaled` reads them:
    a float32 cast of them, or a 16-bit `x` that `scaled`'s float32 result promotes exactly."""
    if is_call(x, CAST):
        return x.args[1] == torch.float32 and _rows_of(x.args[0], normed)
    return _rows_of(x, normed) and val(scaled).dtype == torch.float32


def _exact_upcast_source(node, inner: set | None = None):
    """The value under casts that keep every value (to the same or a wider float dtype; added to `inner`)."""
    while is_call(node, CAST) and FLOAT_WIDTH.get(node.args[1], 0) >= FLOAT_WIDTH.get(val(node.args[0]).dtype, 9):
        if inner is not None:
            inner.add(node)
        node = node.args[0]
    return node


def _strip_exact(node, inner: set):
    """The value under order-keeping reshapes and exact upcasts (both added to `inner`)."""
    while True:
        below = _exact_upcast_source(node)
        if below is node and any(is_call(node, t) for t in ORDER_KEEPING):
            below = node.args[0]
        if below is node:
            return node
        inner.add(node)
        node = below


def _rows_of(node, normed: torch.fx.Node) -> bool:
    """`node` is `normed`, or normed reshaped with its last dimension kept (the same rows, differently stacked)."""
    while node is not normed and any(is_call(node, r) for r in RESHAPES) and \
            statically_known_true(val(node).shape[-1] == val(node.args[0]).shape[-1]):
        node = node.args[0]
    return node is normed


def _ungrouped(node, inner: set) -> tuple:
    """(value, group size, padded) of `node` = a view of value that splits its last dimension into groups
    of a constant size (None: not grouped; the whole row is one group), maybe of value zero-padded at the
    end of its rows first (a last, partial group). The view must keep the leading dimensions (its groups
    then lie within rows) or the row width must be a known multiple of the group."""
    if not any(is_call(node, r) for r in RESHAPES):
        return node, None, False
    padded_source = node.args[0]
    source = _unpadded(padded_source, inner)
    shape, source_shape = val(node).shape, val(padded_source).shape
    group = shape[-1]
    if not isinstance(group, int):
        sizes = node.args[1] if len(node.args) > 1 else None
        group = sizes[-1] if isinstance(sizes, (list, tuple)) and isinstance(sizes[-1], int) and sizes[-1] > 0 else None
    if group is None:
        return node, None, False
    width = source_shape[-1]
    keeps_rows = len(shape) == len(source_shape) + 1 and all(
        statically_known_true(a == b) for a, b in zip(shape[:-2], source_shape[:-1]))
    if not (keeps_rows or statically_known_true(width % group == 0)):
        raise NotFused(f"`{node.name}` groups the flattened rows by {group}, and the row width {width} is not known to be "
                       f"a multiple of {group} (a group could span two rows)")
    inner.add(node)
    padded = source is not padded_source and not statically_known_true(width == val(source).shape[-1])
    return source, (None if statically_known_true(width == group) else group), padded


def _unpadded(node, inner: set):
    """The value a `constant_pad_nd(value, [0, p], 0)` pads with zeros at the end of its last dimension
    (F.pad up to a multiple of the group), or `node` itself."""
    if is_call(node, PAD) and list(node.args[1][:1]) == [0] and len(node.args[1]) == 2 and \
            float(node.args[2] if len(node.args) > 2 else 0.0) == 0.0:
        inner.add(node)
        return node.args[0]
    return node


def _strip(node, targets, inner: set):
    while any(is_call(node, t) for t in targets):
        inner.add(node)
        node = node.args[0]
    return node


def _view_back(final: torch.fx.Node, inner: set, normed: torch.fx.Node, padded: bool) -> torch.fx.Node:
    """The e4m3 value as the graph uses it: `final`, or one reshape of it (back to rows), then, for padded
    rows, the slice that cuts exactly the padding off (start 0, step 1, the norm's width)."""
    users = list(final.users)
    value = final
    if len(users) == 1 and any(is_call(users[0], r) for r in RESHAPES):
        inner.add(final)
        value = users[0]
    if not padded:
        return value
    slices = list(value.users)
    hidden = val(normed).shape[-1]
    if len(slices) == 1 and is_call(slices[0], SLICE) and slices[0].args[1] in (-1, val(value).dim() - 1) and \
            (slices[0].args[2] if len(slices[0].args) > 2 else 0) in (0, None) and \
            (slices[0].args[4] if len(slices[0].args) > 4 else 1) == 1 and \
            statically_known_true(val(slices[0]).shape[-1] == hidden):
        inner.add(value)
        return slices[0]
    raise NotFused(f"the padded FP8 values `{value.name}` are not sliced back to the norm's width {hidden}")


def depends_on(node: torch.fx.Node, fused: torch.fx.Node) -> bool:
    """Whether `node` is computed from `fused`'s outputs (every input path, not a bounded depth: nodes
    before `fused` in the graph cannot depend on it)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current is fused:
            return True
        if current in seen or current < fused:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def _check_private(match: Fp8Match, normed: torch.fx.Node) -> None:
    """Every node inside the quantization (but its outputs) is used by the quantization alone, or only for
    its size where it has the norm's shape (`size_readers`: the rewrite re-points those)."""
    allowed = match.inner | {match.quantized}
    outputs = {match.quantized, match.scale}
    for node in match.inner - outputs:
        for user in node.users:
            if is_call(user, SYM_SIZE) and _same_shape(node, normed):
                continue
            if user not in allowed and user not in outputs:
                raise NotFused(f"`{node.name}` ({op_name(node)}) inside the FP8 quantization is also used by `{user.name}`")


def size_readers(nodes, normed: torch.fx.Node) -> list[torch.fx.Node]:
    """The `sym_size` nodes that read the size of `normed` or of a node of `nodes` with normed's shape."""
    return [user for node in {*nodes, normed} if _same_shape(node, normed) for user in node.users if is_call(user, SYM_SIZE)]


def _same_shape(node: torch.fx.Node, normed: torch.fx.Node) -> bool:
    if not isinstance(val(node), torch.Tensor):
        return False
    shape, normed_shape = val(node).shape, val(normed).shape
    return len(shape) == len(normed_shape) and all(statically_known_true(a == b) for a, b in zip(shape, normed_shape))


def op_name(node) -> str:
    """The op a node calls, as a short name (`amax`, `div`)."""
    return getattr(getattr(getattr(node, "target", None), "overloadpacket", None), "__name__", None) or \
        str(getattr(node, "target", node))
