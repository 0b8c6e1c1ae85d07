"""Fold an FP8 quantization of a fused site's norm output into the fused op (its FP8 variant).

In FP8 serving the RMSNorm output goes straight into an e4m3 quantization for the next GEMM. Once the
fusion pass has replaced `all_reduce -> add -> RMSNorm` by the opaque fused op, Inductor can no longer
fuse that quantization into the norm's kernel, so this pass (run after the fusion pass) rewrites
`fused op -> normed -> quantization` into `fxfuse::allreduce_residual_rmsnorm_fp8`
(`fxfuse.op.fp8_schema`), which returns the e4m3 values and their scales (and the normed output only
if something else reads it). It recognizes, in the post-grad graph, these spellings of the
quantization of the normed value `n` (an `Fp8Recipe`, `fxfuse.op.fp8_recipe`):
- dynamic per group or per row: `x = n.float()` (n maybe first reshaped to other leading dimensions,
  as a linear flattens its input to rows; x optionally viewed as `[..., groups, group]`, the last
  dimension split, maybe zero-padded to a multiple of the group first and sliced back after),
  `amax(abs(...))` over the last dimension (of `x`, or of `n` itself: the scale is then computed in the activation dtype, as torchao does, and cast to float32), an optional
  `clamp_min` of the maximum, `/ 448`, then `x / scale` (the scale unsqueezed or kept with keepdim),
  an optional clamp to +-448, `.to(float8_e4m3fn)` and an optional view back: this project's
  models/quant `quantize_activations`, DeepSeek-V3's `act_quant` arithmetic, torchao's dynamic PerRow;
- static per tensor: `x * s` or `x / s` with `s` one float32 value computed before the site (a
  calibrated scale), an optional clamp, `.to(float8_e4m3fn)`.
Anything else that casts the norm's output to an FP8 dtype is left alone; the reason is kept on the
fused node (`meta[FP8_REASON]`) for `fxfuse report`. Values never change: the fused op's arithmetic is
the recipe's, which equals the unfused code's on CPU.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.fp8_recipe import FP8_DTYPE, FP8_MAX, Fp8Recipe
from fxfuse.op.fp8_schema import allreduce_residual_rmsnorm_fp8, allreduce_residual_rmsnorm_fp8_tensor_eps
from fxfuse.op.schema import NORM_OPS, allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes.canonical_form import CAST, DIV, MUL, VIEW, emit_node, is_call, val
from fxfuse.passes.config import FP8_EPILOGUE, PassConfig

aten = torch.ops.aten
ABS = aten.abs.default
AMAX = aten.amax.default
CLAMP = aten.clamp.default
CLAMP_MIN = aten.clamp_min.default
CLAMP_MAX = aten.clamp_max.default
UNSQUEEZE = aten.unsqueeze.default
PAD = aten.constant_pad_nd.default
SLICE = aten.slice.Tensor
RESHAPES = (VIEW, aten.reshape.default, aten._unsafe_view.default)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: Node meta key holding why a fused site's FP8 quantization was left out.
FP8_REASON = "fxfuse_fp8_left_out"


@dataclass
class Fp8Match:
    """A recognized quantization of one fused site's normed output."""

    recipe: Fp8Recipe
    quantized: torch.fx.Node  # the e4m3 value as the graph reads it (maybe a view back)
    scale: torch.fx.Node | None  # the float32 scale value the graph reads (dynamic scalings)
    static_scale: torch.fx.Node | None
    inner: set  # nodes only the quantization uses (erased after the rewrite)
    divisor: torch.fx.Node | None = None  # a 0-dim CPU tensor the dynamic scale divides by (None: 448)


class NotFused(Exception):
    """A quantization follows the norm but cannot be folded; the message says why."""


def run(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Fold every recognized FP8 quantization of a fused site's normed output (when `config` enables
    the pattern); returns how many."""
    if not config.enabled(FP8_EPILOGUE):
        return 0
    folded = 0
    for op in NORM_OPS:
        for fused in list(graph.find_nodes(op="call_function", target=op)):
            normed = _output(fused, 0)
            if normed is None or not _casts_to_fp8_soon(normed):
                continue
            try:
                match = find_quantization(normed)
                _rewrite(graph, fused, normed, match)
                folded += 1
            except NotFused as why:
                fused.meta[FP8_REASON] = str(why)
    return folded


def _output(fused: torch.fx.Node, index: int) -> torch.fx.Node | None:
    return next((u for u in fused.users if u.target is operator.getitem and u.args[1] == index), None)


def _casts_to_fp8_soon(value: torch.fx.Node, depth: int = 8) -> bool:
    """Whether some node within `depth` uses of `value` converts to an FP8 dtype."""
    frontier = {value}
    for _ in range(depth):
        frontier = {user for node in frontier for user in node.users}
        if any(is_call(node, CAST) and node.args[1] in FP8_DTYPES for node in frontier):
            return True
    return False


def find_quantization(normed: torch.fx.Node) -> Fp8Match:
    """The quantization of `normed` in one of the spellings of the module docstring; NotFused says why not."""
    casts = [node for node in _downstream(normed) if is_call(node, CAST) and node.args[1] in FP8_DTYPES]
    if len(casts) != 1:
        raise NotFused(f"the norm's output is cast to FP8 {len(casts)} times")
    final = casts[0]
    if final.args[1] != FP8_DTYPE:
        raise NotFused(f"the quantization casts to {final.args[1]}, not float8_e4m3fn")
    inner = {final}
    scaled = _strip_clamps(final.args[0], inner)
    if is_call(scaled, MUL) or (is_call(scaled, DIV) and not _derived_from(scaled.args[1], normed)):
        match = _static(scaled, normed, final, inner)
    elif is_call(scaled, DIV):
        match = _dynamic(scaled, normed, final, inner)
    else:
        raise NotFused(f"`{scaled.name}` ({_op(scaled)}) before the FP8 cast is neither a division by a scale nor a "
                       "multiplication by one")
    _check_private(match, normed)
    return match


def _downstream(value: torch.fx.Node, depth: int = 10) -> list[torch.fx.Node]:
    seen, frontier = [], [value]
    for _ in range(depth):
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen += frontier
    return seen


def _strip_clamps(node, inner: set):
    """The value under clamps to +-448 (clamp, clamp_min, clamp_max in any order); NotFused for another bound."""
    while is_call(node, CLAMP) or is_call(node, CLAMP_MIN) or is_call(node, CLAMP_MAX):
        bounds = list(node.args[1:]) + [node.kwargs.get(k) for k in ("min", "max") if k in node.kwargs]
        if any(b is not None and abs(float(b)) != FP8_MAX for b in bounds):
            raise NotFused(f"`{node.name}` clamps to {bounds}, not to +-448 before the FP8 cast")
        inner.add(node)
        node = node.args[0]
    return node


def _value32(node, normed: torch.fx.Node) -> torch.fx.Node | None:
    """`node` is normed in float32 (normed itself, its cast, either maybe reshaped to other leading
    dimensions, as a linear flattens its input to rows): that node; else None."""
    if is_call(node, CAST) and node.args[1] == torch.float32:
        return node if _rows_of(node.args[0], normed) else None
    return node if val(normed).dtype == torch.float32 and _rows_of(node, normed) else None


def _rows_of(node, normed: torch.fx.Node) -> bool:
    """`node` is `normed`, or normed reshaped with its last dimension kept (the same rows, differently stacked)."""
    while node is not normed and any(is_call(node, r) for r in RESHAPES) and \
            statically_known_true(val(node).shape[-1] == val(node.args[0]).shape[-1]):
        node = node.args[0]
    return node is normed


def _static(scaled: torch.fx.Node, normed: torch.fx.Node, final: torch.fx.Node, inner: set) -> Fp8Match:
    """`x * s` or `x / s` with s one float32 value computed apart from the site."""
    x, scale = scaled.args[0], scaled.args[1]
    if _value32(x, normed) is None:
        raise NotFused(f"`{scaled.name}` scales `{getattr(x, 'name', x)}`, not the norm's output in float32")
    value = val(scale)
    if value is None or value.numel() != 1 or value.dtype != torch.float32:
        raise NotFused(f"the static FP8 scale `{getattr(scale, 'name', scale)}` is not one float32 value")
    if value.device != val(normed).device:
        raise NotFused(f"the static FP8 scale `{scale.name}` is on {value.device}, the activations on {val(normed).device}")
    inner.add(scaled)
    recipe = Fp8Recipe("static_mul" if is_call(scaled, MUL) else "static_div")
    return Fp8Match(recipe, _view_back(final, inner), None, scale, inner)


def _dynamic(divided: torch.fx.Node, normed: torch.fx.Node, final: torch.fx.Node, inner: set) -> Fp8Match:
    """`x_grouped / scale` with scale = clamp_min(amax(|grouped|), lb) / 448 (maybe via the activation dtype)."""
    numerator, denominator = divided.args
    hidden = val(normed).shape[-1]
    x, group = _ungrouped(numerator, inner)
    if _value32(x, normed) is None:
        raise NotFused(f"`{divided.name}` divides `{getattr(numerator, 'name', numerator)}`, not the norm's output in float32")
    inner.add(divided)
    scale = _strip_reshapes(denominator, (UNSQUEEZE,) + RESHAPES, inner)
    scale_value = scale
    scale_dtype = torch.float32
    if is_call(scale, CAST) and scale.args[1] == torch.float32:  # scale computed in the activation dtype (torchao)
        scale = scale.args[0]
        scale_dtype = val(scale).dtype
    divisor = _scale_divisor(scale, inner)
    inner.add(scale)
    amax, min_amax = scale.args[0], 0.0
    if is_call(amax, CLAMP_MIN) or is_call(amax, CLAMP):
        bound = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("min")
        if len(amax.args) > 2 or amax.kwargs.get("max") is not None or not isinstance(bound, (int, float)):
            raise NotFused(f"`{amax.name}` bounds the group maximum otherwise than from below by a constant")
        inner.add(amax)
        amax, min_amax = amax.args[0], float(bound)
    if not is_call(amax, AMAX) or not is_call(amax.args[0], ABS):
        raise NotFused(f"`{getattr(amax, 'name', amax)}` is not the maximum of absolute values")
    source = amax.args[0].args[0]
    dims = [d % val(source).dim() for d in amax.args[1]]
    if dims != [val(source).dim() - 1]:
        raise NotFused(f"`{amax.name}` reduces over dimensions {amax.args[1]}, not the last one")
    inner.update({amax, amax.args[0]})
    source_x, source_group = _ungrouped(source, inner)
    same_values = _value32(source_x, normed) is not None if scale_dtype == torch.float32 else _rows_of(source_x, normed)
    if source_group != group or not same_values:
        raise NotFused(f"the FP8 scale of `{divided.name}` is computed over other values than it divides")
    size = group or hidden
    recipe = Fp8Recipe("per_group" if size < hidden else "per_row", size if size < hidden else 0, min_amax, scale_dtype)
    refusal = recipe.refusal(hidden)
    if refusal is not None:
        raise NotFused(refusal)
    return Fp8Match(recipe, _view_back(final, inner), scale_value, None, inner, divisor)


def _scale_divisor(scale, inner: set) -> torch.fx.Node | None:
    """What the group maximum is divided by: 448 (None), or a 0-dim CPU float tensor node (dynamo made the
    constant a graph input under `dynamic=True`: its value is read when the op runs)."""
    if not is_call(scale, DIV):
        raise NotFused(f"the FP8 scale `{getattr(scale, 'name', scale)}` is not the group maximum divided by a constant")
    divisor = scale.args[1]
    if isinstance(divisor, (int, float)):
        if float(divisor) != FP8_MAX:
            raise NotFused(f"the FP8 scale `{scale.name}` divides the group maximum by {divisor}, not 448")
        return None
    if is_call(divisor, CAST) and divisor.args[1] == torch.float32 and len(divisor.users) == 1:
        inner.add(divisor)
        divisor = divisor.args[0]
    value = val(divisor)
    if value is None or value.dim() != 0 or value.device.type != "cpu" or not value.is_floating_point():
        raise NotFused(f"the FP8 scale `{scale.name}` divides by `{getattr(divisor, 'name', divisor)}`, not by a constant")
    return divisor


def _ungrouped(node, inner: set) -> tuple:
    """(value, group size) of `node` = a view of value that splits its last dimension into groups of a
    constant size (None: not grouped; the whole row is one group), maybe of value zero-padded at the
    end of its rows first (a last, partial group). The view must keep the leading dimensions (its groups
    then lie within rows) or the row width must be a known multiple of the group."""
    if not any(is_call(node, r) for r in RESHAPES):
        return node, None
    source, shape = _unpadded(node.args[0], inner), val(node).shape
    source_shape = val(source).shape if val(source) is not None else None
    sizes = node.args[1] if len(node.args) > 1 else None
    group = sizes[-1] if isinstance(sizes, (list, tuple)) and isinstance(sizes[-1], int) and sizes[-1] > 0 else shape[-1]
    if source_shape is None or not isinstance(group, int):
        return node, None
    hidden = source_shape[-1]
    keeps_rows = len(shape) == len(source_shape) + 1 and all(
        statically_known_true(a == b) for a, b in zip(shape[:-2], source_shape[:-1]))
    if not (keeps_rows or statically_known_true(hidden % group == 0)):
        raise NotFused(f"`{node.name}` groups the flattened rows by {group}, and the row width {hidden} is not known to be "
                       f"a multiple of {group} (a group could span two rows)")
    inner.add(node)
    return source, (None if statically_known_true(hidden == group) else group)


def _unpadded(node, inner: set):
    """The value a `constant_pad_nd(value, [0, p], 0)` pads with zeros at the end of its last dimension
    (F.pad up to a multiple of the group), or `node` itself."""
    if is_call(node, PAD) and list(node.args[1][:1]) == [0] and len(node.args[1]) == 2 and \
            float(node.args[2] if len(node.args) > 2 else 0.0) == 0.0:
        inner.add(node)
        return node.args[0]
    return node


def _strip_reshapes(node, targets, inner: set):
    while any(is_call(node, t) for t in targets):
        inner.add(node)
        node = node.args[0]
    return node


def _view_back(final: torch.fx.Node, inner: set) -> torch.fx.Node:
    """The e4m3 value as the graph uses it: a single reshape of `final` back to rows (and a slice of a
    padded row back to its width), or `final`."""
    users = list(final.users)
    if len(users) == 1 and any(is_call(users[0], r) for r in RESHAPES):
        inner.add(final)
        view = users[0]
        slices = list(view.users)
        if len(slices) == 1 and is_call(slices[0], SLICE) and slices[0].args[1] in (-1, val(view).dim() - 1) and \
                slices[0].args[2] == 0:
            inner.add(view)
            return slices[0]
        return view
    return final


def _derived_from(node, source: torch.fx.Node, depth: int = 12) -> bool:
    frontier = {node} if isinstance(node, torch.fx.Node) else set()
    for _ in range(depth):
        if source in frontier:
            return True
        frontier = {arg for n in frontier for arg in n.all_input_nodes}
    return source in frontier


def _check_private(match: Fp8Match, normed: torch.fx.Node) -> None:
    """Every node inside the quantization (but its outputs) is used by the quantization alone."""
    allowed = match.inner | {match.quantized}
    outputs = {match.quantized, match.scale}
    for node in match.inner - outputs:
        for user in node.users:
            if user not in allowed and user not in outputs:
                raise NotFused(f"`{node.name}` ({_op(node)}) inside the FP8 quantization is also used by `{user.name}`")
    if match.static_scale is not None and _derived_from(match.static_scale, normed):
        raise NotFused("the static FP8 scale is computed from the norm's output")


def _op(node: torch.fx.Node) -> str:
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", None) or str(node.target)


def _rewrite(graph: torch.fx.Graph, fused: torch.fx.Node, normed: torch.fx.Node, match: Fp8Match) -> None:
    """Replace `fused` by the FP8 variant; the quantization's outputs read the new op's."""
    static_scale = match.static_scale
    if static_scale is not None and not static_scale < fused:
        raise NotFused(f"the static FP8 scale `{static_scale.name}` is computed after the all-reduce")
    recipe = match.recipe
    hidden = val(normed).shape[-1]
    scales_shape = [*val(normed).shape[:-1], recipe.groups(hidden)]
    for old, shape in ((match.quantized, list(val(normed).shape)), (match.scale, scales_shape)):
        if old is not None and list(val(old).shape) != shape and _view_sizes(val(old).shape) is None:
            raise NotFused(f"`{old.name}` has the symbolic shape {list(val(old).shape)}, not the op's {shape}")
    feeds = {user: _feed_chain(user, match.inner) for user in normed.users}
    others = [user for user, chain in feeds.items() if chain is None]
    for chain in feeds.values():
        match.inner.update(chain or ())
    return_normed = bool(others)
    op = allreduce_residual_rmsnorm_fp8_tensor_eps if fused.target is allreduce_residual_rmsnorm_tensor_eps else allreduce_residual_rmsnorm_fp8
    norm = [fused.args[i] if len(fused.args) > i else fused.kwargs.get(name, default)
            for i, name, default in ((5, "weight_offset", 0.0), (6, "weight_in_fp32", False))]
    args = (*fused.args[:5], recipe.scaling, recipe.group_size, recipe.min_amax, recipe.scale_dtype, static_scale, return_normed,
            *norm, match.divisor)
    new = emit_node(graph, op, args, before=fused, meta_from=fused)
    outputs = [emit_node(graph, operator.getitem, (new, i), before=fused, meta_from=fused) for i in range(4)]
    quantized, scales, residual_out, new_normed = outputs
    old_residual = _output(fused, 1)
    if old_residual is not None:
        old_residual.replace_all_uses_with(residual_out)
    _replace(graph, match.quantized, quantized)
    if match.scale is not None:
        _replace(graph, match.scale, scales)
    if return_normed:
        for user in others:
            user.replace_input_with(normed, new_normed)
    doomed = match.inner | {match.quantized, match.scale, normed, old_residual, fused, *outputs}
    for node in reversed(list(graph.nodes)):  # the quantization's, the old op's and unused outputs' nodes
        if node in doomed and not node.users:
            graph.erase_node(node)
    if fused in set(graph.nodes):  # never two collectives where there was one
        raise RuntimeError(f"fxfuse internal error: `{fused.name}` is still read after its FP8 rewrite")


def _feed_chain(node: torch.fx.Node, inner: set) -> set | None:
    """The casts and reshapes from `node` (a user of normed) into the quantization, when that is all
    `node` leads to (they go with it); None when something else reads `node` or what it leads to."""
    if node in inner:
        return {node}
    if not (is_call(node, CAST) or any(is_call(node, r) for r in RESHAPES)) or not node.users:
        return None
    chain = {node}
    for user in node.users:
        below = _feed_chain(user, inner)
        if below is None:
            return None
        chain |= below
    return chain


    return False


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new_value: torch.fx.Node) -> None:
    """Make the users of `old` read `new_value` (viewed to `old`'s shape when that differs)."""
    target = val(old)
    source = new_value
    if list(val(new_value).shape) != list(target.shape):
        source = emit_node(graph, VIEW, (new_value, _view_sizes(target.shape)), before=min(old.users), meta_from=old)
    old.replace_all_uses_with(source)


def _view_sizes(shape) -> list | None:
    """`view` sizes for `shape` that name no symbol: -1 for its one symbolic dimension; None if it has more."""
    sizes = [d if isinstance(d, int) else -1 for d in shape]
    return sizes if sizes.count(-1) <= 1 else None
