"""Which recipe of the fused op a quantization computes, found by running the code itself on probe rows.

`find_fold(region)` runs the quantization subgraph that `fxfuse.passes.fp8_region` proved the structure
of, as written (its own ATen ops, eagerly, on CPU), on the probe rows of `fxfuse.passes.fp8_probes`
(for each set of values its parameters take, and, where the row width is symbolic, at other widths its
guards allow too). Then it tries the recipes the op can run (`fxfuse.op.fp8_recipe.Fp8Recipe`, with the
graph's constants as candidate bounds, its group sizes, its 16-bit dtypes as the scale's, its parameters
as a static scale, divisor or clamp bound), in a fixed order of preference, and takes the first whose
reference `quantize_fp8` gives the code's e4m3 codes and float32 scales bit for bit: shapes, dtypes,
values, -0.0 and NaN positions (the op's outputs are dense; a code whose codes are a slice of a padded
buffer has the same values, densely). Where two recipes are equal on every probe (on a torch whose cast
saturates, a clamp to +-448 and none), the first in that order is taken: clamped before unclamped. No
recipe equal on every probe: `NotFused`, naming the closest recipe and its first difference.

Searches are kept per structure of the subgraph (`signature`): the sites of one model share it, so a
model's 122 quantizations are run once.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.fp8_recipe import (
    FP8_DTYPE, FP8_MAX, GRAPH_BOUND_MARK, Fp8Limits, Fp8Recipe, dynamic_scales, group_maxima, quantize_fp8, rounded_to,
)
from fxfuse.passes.canonical_form import val
from fxfuse.passes.fp8_probes import parameter_draws, probe_rows
from fxfuse.passes.fp8_region import REDUCTIONS, NotFused, Region, numel, row_count

#: Rows of one run where the row count is a symbol (more than the probes: each run holds all of them).
PROBE_ROWS = 128
#: Searches kept, by subgraph signature: ("fold", recipe, roles) or ("refuse", reason).
_SEARCHES: dict[tuple, tuple] = {}
_MAX_SEARCHES = 512


@dataclass
class SearchTally:
    """How many searches ran in this process (`runs`), how long they took, and how many quantizations found
    theirs already kept (`hits`): the compile records take the change over a pass run."""

    runs: int = 0
    seconds: float = 0.0
    hits: int = 0


SEARCHES = SearchTally()


@dataclass(frozen=True)
class Fp8Fold:
    """What the fold emits: the recipe, and which graph nodes carry the values it takes with each call."""

    recipe: Fp8Recipe
    static_scale: torch.fx.Node | None = None
    divisor: torch.fx.Node | None = None
    clamp_bound: torch.fx.Node | None = None
    amax_bound: torch.fx.Node | None = None
    scale_bound: torch.fx.Node | None = None


@dataclass(frozen=True)
class _Roles:
    """Which of the region's runtime values (`Region.runtime_values`, by index; the static scale: of its
    parameters) a candidate takes for each number of the op it may be given (None: a constant)."""

    static_scale: int | None = None
    divisor: int | None = None
    clamp_bound: int | None = None
    amax_bound: int | None = None
    scale_bound: int | None = None

    def limits(self, run: "_Run") -> Fp8Limits:
        """The numbers of `run` for these roles."""
        def value(index, default):
            return default if index is None else run.runtime[index]

        return Fp8Limits(value(self.divisor, FP8_MAX), value(self.clamp_bound, FP8_MAX), value(self.amax_bound, None),
                         value(self.scale_bound, None))

    def describe(self, run: "_Run") -> list[str]:
        """The values these roles take in `run`, in words."""
        words = [] if self.static_scale is None else [f"a static scale {run.parameters[self.static_scale]!r}"]
        for name, index in (("the divisor", self.divisor), ("the clamp bound", self.clamp_bound),
                            ("the maximum's bound", self.amax_bound), ("the scale's bound", self.scale_bound)):
            if index is not None:
                words.append(f"{name} {run.runtime[index]!r} from the graph")
        return words


@dataclass
class _Run:
    """One execution of the subgraph: its input rows (the norm's output), parameter values, and outputs."""

    env: dict
    normed: torch.Tensor
    labels: list[str]
    parameters: tuple
    codes: torch.Tensor
    scales: torch.Tensor | None
    runtime: tuple = ()  # the values of the region's runtime values in this run
    _maxima: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """The number of probe rows in this run."""
        return math.prod(self.normed.shape[:-1])

    def maxima(self, recipe: Fp8Recipe) -> torch.Tensor:
        """The group maxima of the run's rows for `recipe`'s grouping (computed once per grouping)."""
        key = (recipe.scaling, recipe.group_size)
        if key not in self._maxima:
            self._maxima[key] = group_maxima(self.normed, recipe)[1]
        return self._maxima[key]


def find_fold(region: Region) -> Fp8Fold:
    """The recipe and parameter roles `region` computes, bit for bit; NotFused (its first difference) if none."""
    key = signature(region)
    found = _SEARCHES.get(key)
    if found is not None:
        SEARCHES.hits += 1
    else:
        started = time.perf_counter()
        try:
            with unset_fake_temporarily(), torch.no_grad():  # the passes run under the compile's fake tensor mode
                recipe, roles = _search(region)
            found = ("fold", recipe, roles)
        except NotFused as why:
            found = ("refuse", str(why))
        SEARCHES.seconds += time.perf_counter() - started
        SEARCHES.runs += 1
        if len(_SEARCHES) >= _MAX_SEARCHES:
            _SEARCHES.clear()
        _SEARCHES[key] = found
    if found[0] == "refuse":
        raise NotFused(found[1])
    _, recipe, roles = found
    runtime = region.runtime_values

    def node(index, nodes):
        return None if index is None else nodes[index]

    return Fp8Fold(recipe, node(roles.static_scale, region.parameters()), node(roles.divisor, runtime),
                   node(roles.clamp_bound, runtime), node(roles.amax_bound, runtime), node(roles.scale_bound, runtime))


# ---------------------------------------------------------------- running the code


def _search(region: Region) -> tuple[Fp8Recipe, _Roles]:
    """The first candidate equal to the code on every run at every size; NotFused with the closest's difference."""
    environments = [_runs(region, env) for env in _environments(region)]
    best = _Closest()
    for base, scale_roles in _scale_candidates(region, environments[0]):
        if base.dynamic and not all(_scales_agree(region, base, scale_roles, runs, best) for runs in environments):
            continue
        for recipe, roles in _code_variants(region, base, scale_roles):
            if all(_codes_agree(recipe, roles, runs, best) for runs in environments):
                _check_scale_count(region, recipe)
                return recipe, roles
    raise NotFused(best.reason())


def _runs(region: Region, env: dict) -> list[_Run]:
    """The subgraph run on every probe row for every draw of its parameters, at the sizes of `env`."""
    normed = val(region.normed)
    leading = [_concrete(size, env) for size in normed.shape[:-1]]
    hidden = _concrete(normed.shape[-1], env)
    rows_per_run = math.prod(leading)
    if rows_per_run == 0 or hidden == 0:
        raise NotFused("the norm's output has no values at the sizes the graph was traced with")
    probes, labels = probe_rows(hidden, normed.dtype, tuple(_group_sizes(region, env, hidden)), tuple(_positive_constants(region)))
    count = -(-probes.shape[0] // rows_per_run)
    order = [index % probes.shape[0] for index in range(count * rows_per_run)]
    runs = []
    for parameters in parameter_draws(len(region.parameters())):
        for start in range(0, len(order), rows_per_run):
            picked = order[start:start + rows_per_run]
            rows = probes[picked].view(*leading, hidden)
            values = _execute(region, rows, env, parameters)
            codes, scales = values[region.codes], values[region.scales] if region.scales is not None else None
            runtime = tuple(float(values[node]) for node in region.runtime_values)
            runs.append(_Run(env, rows, [labels[i] for i in picked], parameters, codes, scales, runtime))
    return runs


def _execute(region: Region, normed: torch.Tensor, env: dict, parameters: tuple) -> dict:
    """The value of every program node for the norm's output `normed` (CPU, eager, the graph's own ops)."""
    values = {region.normed: normed}
    for node in region.leaves["size"]:
        values[node] = _concrete(node.meta["val"], env)
    for node in region.leaves["constant"]:
        values[node] = getattr(node.graph.owning_module, node.target).detach().cpu()
    for node, value in zip(region.parameters(), parameters):
        fake = val(node)
        values[node] = torch.full([_concrete(s, env) for s in fake.shape], value, dtype=fake.dtype)
    for node in region.program:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), _on_cpu)
        try:
            values[node] = node.target(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the code itself fails on these rows: say so
            raise NotFused(f"the FP8 quantization fails when run on rows of {normed.shape[-1]} values at `{node.name}`: "
                           f"{type(error).__name__}: {error}") from None
    return values


def _on_cpu(arg):
    return torch.device("cpu") if isinstance(arg, torch.device) else arg


# ---------------------------------------------------------------- sizes


def _shape_env(region: Region):
    for node in [region.normed, *region.program, *region.leaves["size"]]:
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else [value]
        for size in sizes:
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def _concrete(size, env: dict) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    missing = [s for s in expr.free_symbols if s not in env]
    if missing:
        raise NotFused(f"the size {size} has no value at compile time (`{missing[0]}`): the quantization cannot be run")
    return int(expr.xreplace({symbol: env[symbol] for symbol in expr.free_symbols}))


def _environments(region: Region) -> list[dict]:
    """Sizes to run the subgraph at: the traced ones (the graph's hints; a symbolic row count made PROBE_ROWS),
    and where the row width is a symbol of its own, two other widths its guards allow (to run a padding
    that the traced width needs none of)."""
    shape_env = _shape_env(region)
    if shape_env is None:
        return [{}]
    base = _hints(shape_env)
    leading = [size for size in val(region.normed).shape[:-1] if isinstance(size, torch.SymInt)]
    if len(leading) == 1 and leading[0].node.expr.is_Symbol and leading[0].node.expr in base:
        rows = {**base, leading[0].node.expr: PROBE_ROWS}  # every probe row in one run, where the guards allow it
        if _allowed(shape_env, rows):
            base = rows
    environments = [base]
    hidden = val(region.normed).shape[-1]
    if isinstance(hidden, torch.SymInt) and hidden.node.expr.is_Symbol and hidden.node.expr in base:
        symbol, traced = hidden.node.expr, base[hidden.node.expr]
        for width in (traced + 1, traced + 3, traced + 64, traced - 1, traced + 128, 2 * traced):
            env = {**base, symbol: width}
            if width > 0 and _allowed(shape_env, env):
                environments.append(env)
            if len(environments) == 3:
                break
    return environments


def _hints(shape_env) -> dict:
    """The traced value of every backed size symbol."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    if hints is None:
        hints = shape_env.var_to_val
    return {symbol: int(hint) if getattr(hint, "is_integer", False) or isinstance(hint, int) else hint
            for symbol, hint in hints.items()}


def _allowed(shape_env, env: dict) -> bool:
    """Whether sizes `env` satisfy the graph's guards and value ranges (the compiled code would run at them)."""
    for symbol, value in env.items():
        bounds = shape_env.var_to_range.get(symbol)
        if bounds is not None and not (bounds.lower <= value <= bounds.upper):
            return False
    for guard in shape_env.guards:
        try:
            if not bool(guard.expr.xreplace(env)):
                return False
        except TypeError:
            return False
    return True


# ---------------------------------------------------------------- candidates


def _group_sizes(region: Region, env: dict, hidden: int) -> list[int]:
    """Group sizes the code may have: the last dimensions its maxima reduce, below the row width."""
    sizes = set()
    for node in region.data:
        if node.op == "call_function" and node.target in REDUCTIONS and val(node.args[0]).dim() > 0:
            last = _concrete(val(node.args[0]).shape[-1], env)
            if 1 < last < hidden:
                sizes.add(last)
    return sorted(sizes)


def _positive_constants(region: Region) -> list[float]:
    """The positive finite numbers among the code's literals and constant tensors of one value."""
    numbers = list(region.literals)
    for node in region.leaves["constant"]:
        value = getattr(node.graph.owning_module, node.target)
        if value.numel() == 1:
            numbers.append(float(value))
    return sorted({n for n in numbers if n > 0 and math.isfinite(n)})


def _scale_candidates(region: Region, runs: list[_Run]):
    """(recipe without the code's fields, its roles) in the order of preference: the static scalings' bases
    first (their scale is a parameter), then the dynamic ones from the plainest up, a constant before a
    value of the graph."""
    normed = val(region.normed)
    for index, parameter in enumerate(region.parameters()):
        if val(parameter).dtype == torch.float32 and val(parameter).device == normed.device:
            yield Fp8Recipe("static_mul"), _Roles(static_scale=index)
            yield Fp8Recipe("static_div"), _Roles(static_scale=index)
    hidden = runs[0].normed.shape[-1]
    constants = _positive_constants(region)
    sixteen_bit = sorted({val(n).dtype for n in region.data if val(n) is not None and val(n).dtype in (torch.bfloat16, torch.float16)},
                         key=str)
    observed = [run.scales for run in runs if run.scales is not None]
    scale_dtypes = [torch.float32] + [d for d in sixteen_bit if all(_representable(s, d) for s in observed)]
    graph_values = {value for run in runs for value in run.runtime}
    bounds = {rounded_to(c, d) for c in (*constants, *graph_values) if c > 0 and math.isfinite(c) for d in scale_dtypes}
    rounded = not observed or all(_powers_of_two_or_bounds(s, bounds) for s in observed)
    roundings = ["none", "ceil", "floor", "nearest"] if rounded else ["none"]
    groupings = [("per_row", 0)] + [("per_group", g) for g in _group_sizes_of(runs, region) if g & (g - 1) == 0 and g < hidden]
    runtime = list(range(len(region.runtime_values)))
    amax_bounds = [(c, None) for c in sorted({0.0, *(rounded_to(c, d) for c in constants for d in (torch.float32, *sixteen_bit))})]
    amax_bounds += [(GRAPH_BOUND_MARK, index) for index in runtime]
    for (scaling, group), (min_amax, amax_role), scale_dtype, divisor in itertools.product(
            groupings, amax_bounds, scale_dtypes, [None, *runtime]):
        scale_bounds = [(c, None) for c in sorted({0.0, *(rounded_to(c, scale_dtype) for c in constants)})]
        scale_bounds += [(GRAPH_BOUND_MARK, index) for index in runtime]
        for (min_scale, scale_role), rounding in itertools.product(scale_bounds, roundings):
            graph = ",".join(name for name, role in (("min_amax", amax_role), ("min_scale", scale_role)) if role is not None)
            for bound_after in ([False, True] if min_scale and rounding != "none" else [False]):
                yield (Fp8Recipe(scaling, group, min_amax, scale_dtype, min_scale, rounding, bound_after_power_of_two=bound_after,
                                 bounds_from_graph=graph),
                       _Roles(divisor=divisor, amax_bound=amax_role, scale_bound=scale_role))


def _code_variants(region: Region, base: Fp8Recipe, roles: _Roles):
    """(recipe, roles) of `base` with each choice of the code's fields: division before the reciprocal's
    multiply, clamped (to 448, then to a value of the graph) before unclamped."""
    clamps = [(True, None)] + [(True, i) for i in range(len(region.runtime_values))] + [(False, None)]
    for reciprocal in ((False, True) if base.dynamic else (False,)):
        for saturate, clamp in clamps:
            yield replace(base, reciprocal=reciprocal, saturate=saturate), replace(roles, clamp_bound=clamp)


def _group_sizes_of(runs: list[_Run], region: Region) -> list[int]:
    return _group_sizes(region, runs[0].env, runs[0].normed.shape[-1])


def _representable(scales: torch.Tensor, dtype: torch.dtype) -> bool:
    finite = scales[torch.isfinite(scales)]
    return bool((finite.to(dtype).float() == finite).all())


def _powers_of_two_or_bounds(scales: torch.Tensor, bounds: set) -> bool:
    """Whether every finite nonzero scale is a power of two or one of `bounds` (a bound after the rounding)."""
    finite = scales[torch.isfinite(scales) & (scales != 0)].double()
    other = finite[torch.frexp(finite).mantissa.abs() != 0.5]
    return all(float(v) in bounds for v in other.unique())


# ---------------------------------------------------------------- comparing


class _Closest:
    """The candidate that agreed longest, and where it first differed (for the reason); the scale counts the
    candidates had, for a code whose scale count none has."""

    def __init__(self) -> None:
        self.progress = (-1,)
        self.detail = "no recipe of the fused op has outputs of the code's shapes"
        self.scale_shapes: dict[str, list[str]] = {}

    def note(self, progress: tuple, describe) -> None:
        if progress > self.progress:
            self.progress, self.detail = progress, describe()

    def note_shape(self, graphs: str, ours: str, recipe: Fp8Recipe) -> None:
        self.scale_shapes.setdefault(graphs, [])
        grouping = recipe.describe().split(",")[0]
        if (ours, grouping) not in self.scale_shapes[graphs]:
            self.scale_shapes[graphs].append((ours, grouping))

    def reason(self) -> str:
        if self.progress[1:] and self.progress[0] == 1 and self.progress[2] == -1 and self.scale_shapes:
            (graphs, options), = list(self.scale_shapes.items())[:1]
            tried = "; ".join(f"{shape} ({grouping})" for shape, grouping in options)
            return (f"no recipe of the fused op computes this quantization: the graph's scales have the shape {graphs}, "
                    f"which no grouping of the op gives: {tried}")
        return f"no recipe of the fused op computes this quantization: {self.detail}"


def _scales_agree(region: Region, recipe: Fp8Recipe, roles: _Roles, runs: list[_Run], best: "_Closest") -> bool:
    """Whether the dynamic `recipe`'s scales equal every run's (a run without a scales output agrees)."""
    for number, run in enumerate(runs):
        if run.scales is None:
            continue
        expected = dynamic_scales(run.maxima(recipe), recipe, roles.limits(run))
        where = _difference(run.scales, expected, run.rows)
        if where is not None and where[0] == -1:
            best.note_shape(str(list(run.scales.shape)), str(list(expected.shape)), recipe)
        if where is not None:
            best.note((1, number, where[0]), lambda: _describe(recipe, roles, run, "scale", where, region.scales))
            return False
    return True


def _codes_agree(recipe: Fp8Recipe, roles: _Roles, runs: list[_Run], best: "_Closest") -> bool:
    """Whether `recipe` with `roles` gives every run's codes."""
    for number, run in enumerate(runs):
        static = None if roles.static_scale is None else torch.tensor(run.parameters[roles.static_scale], dtype=torch.float32)
        codes, _ = quantize_fp8(run.normed, recipe, static, roles.limits(run))
        where = _difference(run.codes, codes, run.rows)
        if where is not None:
            best.note((2, number, where[0]), lambda: _describe(recipe, roles, run, "e4m3 value", where))
            return False
    return True


def _difference(got: torch.Tensor, expected: torch.Tensor, rows: int) -> tuple | None:
    """None if `expected`, viewed in `got`'s shape, equals it bit for bit (NaN where `got` has NaN); else
    (the probe row of the first difference among `rows`, got's value, expected's value), or (-1, got's
    shape, expected's shape) when they cannot be compared."""
    if got.dtype != expected.dtype or got.numel() != expected.numel():
        return (-1, f"{list(got.shape)} {got.dtype}", f"{list(expected.shape)} {expected.dtype}")
    expected = expected.reshape(got.shape)
    if got.dtype == FP8_DTYPE:
        a, b = got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
        nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    else:
        bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}
        nan_a, nan_b = got.isnan(), expected.isnan()
        a, b = got.contiguous().view(bits[got.dtype]), expected.contiguous().view(bits[got.dtype])
    differ = ((a != b) & ~(nan_a & nan_b)) | (nan_a != nan_b)
    if not differ.any():
        return None
    flat = int(differ.reshape(-1).nonzero()[0])
    return (flat // max(1, got.numel() // rows), _show(got.reshape(-1)[flat]), _show(expected.reshape(-1)[flat]))


def _show(value: torch.Tensor) -> str:
    if value.dtype == FP8_DTYPE:
        return f"{float(value.float())!r} (0x{int(value.view(torch.uint8)):02x})"
    return repr(float(value))


def _describe(recipe: Fp8Recipe, roles: _Roles, run: _Run, what: str, where: tuple, node: torch.fx.Node | None = None) -> str:
    """The closest recipe and where it first differs from the code, in words."""
    bound = roles.describe(run)
    closest = f"the closest, `{recipe.describe()}`" + (f" with {', '.join(bound)}" if bound else "")
    graphs = f"`{node.name}` (the float32 value read besides the e4m3 values)" if node is not None else "the graph"
    if where[0] == -1:
        return f"{closest}, gives {what}s of {where[2]} where {graphs} has {where[1]}"
    row = min(where[0], len(run.labels) - 1)
    return f"{closest}, first differs on the probe row \"{run.labels[row]}\": {what} {where[2]} where {graphs} has {where[1]}"


def _check_scale_count(region: Region, recipe: Fp8Recipe) -> None:
    """NotFused unless the code's scales are one per group of every row, at every size (not just the traced)."""
    if region.scales is None or not recipe.dynamic:
        return
    normed = val(region.normed)
    hidden = normed.shape[-1]
    got, expected = numel(val(region.scales)), row_count(region.normed) * recipe.groups(hidden)
    if statically_known_true(got == expected):
        return
    shape_env = _shape_env(region)
    if shape_env is not None and isinstance(hidden, torch.SymInt) and hidden.node.expr.is_Symbol:
        base = _hints(shape_env)
        widths = [{**base, hidden.node.expr: w} for w in range(1, 4 * max(recipe.group_size, 1) + 2)]
        allowed = [env for env in widths if _allowed(shape_env, env)]
        if allowed and all(_concrete(got, env) == _concrete(expected, env) for env in allowed):
            return  # equal at every width the graph's guards allow, over four periods of the group
    raise NotFused(f"the code's scales `{region.scales.name}` have {got} values where the op's have {expected} (one "
                   "per group of every row)")


# ---------------------------------------------------------------- signatures


def signature(region: Region) -> tuple:
    """The structure of the subgraph: its ops, arguments, constants, dtypes and shapes, with nodes named by
    their place in it (equal for the sites of a model, which share one search)."""
    names = {region.normed: ("normed",)}
    for kind, nodes in region.leaves.items():
        for index, node in enumerate(nodes):
            names[node] = (kind, index)
    for index, node in enumerate(region.program):
        names[node] = ("node", index)

    def describe(arg):
        if isinstance(arg, torch.fx.Node):
            return names.get(arg, ("outside", arg.name))
        if isinstance(arg, (list, tuple)):
            return tuple(describe(a) for a in arg)
        return repr(arg)

    def shape_of(node):
        value = node.meta.get("val")
        return (str(value.dtype), str(list(value.shape)), str(value.device.type)) if isinstance(value, torch.Tensor) else str(value)

    constants = tuple(_constant_key(node) for node in region.leaves["constant"])
    parameters = tuple(shape_of(node) for node in region.parameters())
    program = tuple((str(node.target), describe(node.args), describe(tuple(sorted(node.kwargs.items()))), shape_of(node))
                    for node in region.program)
    outputs = (names[region.codes], names.get(region.scales))
    return shape_of(region.normed), constants, parameters, program, outputs


def _constant_key(node: torch.fx.Node) -> tuple:
    value = getattr(node.graph.owning_module, node.target)
    return (str(value.dtype), tuple(value.shape), tuple(value.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist())
            if value.numel() <= 1024 else id(value))
