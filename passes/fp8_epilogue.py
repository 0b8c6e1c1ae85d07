"""Fold an FP8 quantization of a fused site's norm output into the fused op (its FP8 variant).

In FP8 serving the RMSNorm output goes straight into an e4m3 quantization for the next GEMM. Once the
fusion pass has replaced `all_reduce -> add -> RMSNorm` by the opaque fused op, Inductor can no longer
fuse that quantization into the norm's kernel, so this pass (run after the fusion pass) rewrites
`fused op -> normed -> quantization` into `fxfuse::allreduce_residual_rmsnorm_fp8`
(`fxfuse.op.fp8_schema`), which returns the e4m3 values and their scales (and the normed output only
if something else reads it). `fxfuse.passes.fp8_quantization_match` recognizes the quantization (the
spellings of this project, DeepSeek-V3, vLLM, SGLang and torchao: per group, per row, static per
tensor, power-of-two scales, reciprocal multiplies) and describes it by an `Fp8Recipe` whose
arithmetic the op reproduces value for value. Anything else that casts the norm's output to an FP8
dtype is left alone; the reason is kept on the fused node (`meta[FP8_REASON]`) for `fxfuse report`.
`fxfuse.passes.site_tiers` drives it site by site (`quantization_of`, then `fold`): a site whose
quantization cannot be folded, or whose norm output also feeds other code Inductor would fuse, goes to
tier (b) there instead of staying the plain fused op.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.fp8_schema import allreduce_residual_rmsnorm_fp8, allreduce_residual_rmsnorm_fp8_tensor_eps, recipe_arguments
from fxfuse.op.schema import NORM_OPS, allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes.canonical_form import CAST, VIEW, emit_node, is_call, val
from fxfuse.passes.fp8_quantization_match import (
    RESHAPES, SQUEEZE_DIMS, UNSQUEEZE, Fp8Match, NotFused, casts_to_fp8_soon, depends_on, find_quantization,
    size_readers,
)

#: Node meta key holding why a fused site's FP8 quantization was left out.
FP8_REASON = "fxfuse_fp8_left_out"


def quantization_of(fused: torch.fx.Node, normed: torch.fx.Node) -> Fp8Match | None:
    """The FP8 quantization of a fused site's normed output that the op can fold, or None: none follows,
    or it cannot be folded (why is kept on the fused node, `meta[FP8_REASON]`)."""
    if not casts_to_fp8_soon(normed):
        return None
    try:
        return find_quantization(fused, normed)
    except NotFused as why:
        fused.meta[FP8_REASON] = str(why)
        return None


def quantization_nodes(normed: torch.fx.Node, match: Fp8Match) -> set[torch.fx.Node]:
    """The nodes the fold would replace: the quantization's, and the casts and reshapes that only lead into it."""
    chains = [_feed_chain(user, match.inner) for user in normed.users]
    return set(match.inner).union({match.quantized, match.scale}, *(chain for chain in chains if chain))


def fold(graph: torch.fx.Graph, fused: torch.fx.Node, normed: torch.fx.Node, match: Fp8Match) -> bool:
    """Replace `fused` by the FP8 variant that also computes `match`; False (the reason kept on the fused
    node, `meta[FP8_REASON]`) when the rewrite finds it cannot."""
    try:
        _rewrite(graph, fused, normed, match)
    except NotFused as why:
        fused.meta[FP8_REASON] = str(why)
        return False
    return True


def output(fused: torch.fx.Node, index: int) -> torch.fx.Node | None:
    """The `getitem` reading output `index` of `fused`, if any."""
    return next((u for u in fused.users if u.target is operator.getitem and u.args[1] == index), None)


def _rewrite(graph: torch.fx.Graph, fused: torch.fx.Node, normed: torch.fx.Node, match: Fp8Match) -> None:
    """Replace `fused` by the FP8 variant; the quantization's outputs read the new op's."""
    for value in (match.static_scale, match.divisor):
        _ready_before(value, fused)
    recipe = match.recipe
    hidden = val(normed).shape[-1]
    plans = {}
    for old, shape, groups_proven in ((match.quantized, list(val(normed).shape), False),
                                      (match.scale, [*val(normed).shape[:-1], recipe.groups(hidden)], True)):
        if old is not None:
            plans[old] = _reshape_plan(list(val(old).shape), shape, groups_proven)
            if plans[old] is None:
                raise NotFused(f"`{old.name}` has the shape {list(val(old).shape)}, which the op's {shape} cannot be "
                               "viewed as")
    for reader in size_readers(match.inner, normed):  # a size read of normed's shape: x has it
        reader.replace_input_with(reader.args[0], fused.args[0])
    feeds = {user: _feed_chain(user, match.inner) for user in normed.users}
    others = [user for user, chain in feeds.items() if chain is None]
    for chain in feeds.values():
        match.inner.update(chain or ())
    return_normed = bool(others)
    op = allreduce_residual_rmsnorm_fp8_tensor_eps if fused.target is allreduce_residual_rmsnorm_tensor_eps else allreduce_residual_rmsnorm_fp8
    norm = [fused.args[i] if len(fused.args) > i else fused.kwargs.get(name, default)
            for i, name, default in ((5, "weight_offset", 0.0), (6, "weight_in_fp32", False))]
    fields = recipe_arguments(recipe)
    args = (*fused.args[:5], *(fields.pop(name) for name in ("scaling", "group_size", "min_amax", "scale_dtype")),
            match.static_scale, return_normed, *norm, match.divisor, *fields.values())
    new = emit_node(graph, op, args, before=fused, meta_from=fused)
    outputs = [emit_node(graph, operator.getitem, (new, i), before=fused, meta_from=fused) for i in range(4)]
    quantized, scales, residual_out, new_normed = outputs
    old_residual = output(fused, 1)
    if old_residual is not None:
        old_residual.replace_all_uses_with(residual_out)
    _replace(graph, match.quantized, quantized, plans[match.quantized])
    if match.scale is not None:
        _replace(graph, match.scale, scales, plans[match.scale])
    if return_normed:
        for user in others:
            user.replace_input_with(normed, new_normed)
    doomed = match.inner | {match.quantized, match.scale, normed, old_residual, fused, *outputs}
    for node in reversed(list(graph.nodes)):  # the quantization's, the old op's and unused outputs' nodes
        if node in doomed and not node.users:
            graph.erase_node(node)
    if fused in set(graph.nodes):  # never two collectives where there was one
        raise RuntimeError(f"fxfuse internal error: `{fused.name}` is still read after its FP8 rewrite")


def _ready_before(value: torch.fx.Node | None, fused: torch.fx.Node) -> None:
    """Make sure the new op, emitted where `fused` is, can read `value`: what computes it after the site
    (a constant, a `full`, pure arithmetic on earlier values) moves up before it, in order; NotFused for a
    value computed from the site's outputs, or one whose computation after the site is not pure."""
    if value is None or value < fused:
        return
    if depends_on(value, fused):
        raise NotFused(f"`{value.name}`, which the FP8 quantization divides or multiplies by, is computed from the "
                       "norm's output")
    pending, stack = set(), [value]
    while stack:
        node = stack.pop()
        if node in pending or node < fused:
            continue
        pending.add(node)
        stack.extend(node.all_input_nodes)
    for node in pending:
        if node.op not in ("get_attr", "call_function") or node.is_impure() or "c10d" in str(node.target):
            raise NotFused(f"`{value.name}`, which the FP8 quantization divides or multiplies by, is computed after "
                           f"the all-reduce by `{node.name}`, which cannot move before it")
    for node in sorted(pending, key=_position(fused.graph)):
        fused.prepend(node)


def _position(graph: torch.fx.Graph):
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


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


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new_value: torch.fx.Node, plan: tuple) -> None:
    """Make the users of `old` read `new_value`, reshaped to `old`'s shape as `plan` (`_reshape_plan`) says."""
    source, before = new_value, min(old.users)
    if plan[0] == "view":
        source = emit_node(graph, VIEW, (new_value, plan[1]), before=before, meta_from=old)
    elif plan[0] == "unsqueeze":
        squeezed, unsqueezed = plan[1:]
        if squeezed:
            source = emit_node(graph, SQUEEZE_DIMS, (source, squeezed), before=before, meta_from=old)
        for dim in unsqueezed:
            source = emit_node(graph, UNSQUEEZE, (source, dim), before=before, meta_from=old)
    old.replace_all_uses_with(source)


def _reshape_plan(shape: list, op_shape: list, groups_proven: bool = False) -> tuple | None:
    """How the op's output of `op_shape` is read as `shape` (same elements in the same order): ("same",),
    ("view", sizes with -1 for the one symbolic dimension), ("unsqueeze", the op's size-1 dimensions
    to squeeze, the dimensions of size 1 to insert), or None when no such reshape is known to fit.
    `groups_proven`: the match proved that `shape` holds one scale per group of the op's rows, so its
    last dimension other than 1 is the op's group count, whatever symbolic form it has
    (`(s + 127) // 128` and `(s + (-s mod 128)) // 128` are one number that sympy cannot equate)."""
    def equal(a, b) -> bool:
        return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))

    if equal(shape, op_shape):
        return ("same",)
    kept, op_kept = [d for d in shape if d != 1], [d for d in op_shape if d != 1]
    squeezes = ("unsqueeze", [i for i, d in enumerate(op_shape) if d == 1], [i for i, d in enumerate(shape) if d == 1])
    if groups_proven and kept and op_kept and equal(kept[:-1], op_kept[:-1]):
        return squeezes
    if not statically_known_true(math.prod(shape) == math.prod(op_shape)):
        return None
    sizes = _view_sizes(shape)
    if sizes is not None:
        return ("view", sizes)
    return squeezes if equal(kept, op_kept) else None


def _view_sizes(shape) -> list | None:
    """`view` sizes for `shape` that name no symbol: -1 for its one symbolic dimension; None if it has more."""
    sizes = [d if isinstance(d, int) else -1 for d in shape]
    return sizes if sizes.count(-1) <= 1 else None
