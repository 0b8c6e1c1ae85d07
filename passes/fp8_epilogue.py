"""Fold an FP8 quantization of a fused site's norm output into the fused op (its FP8 variant).

In FP8 serving the RMSNorm output goes straight into an e4m3 quantization for the next GEMM. Once the
fusion pass has replaced `all_reduce -> add -> RMSNorm` by the opaque fused op, Inductor can no longer
fuse that quantization into the norm's kernel, so this pass (run after the fusion pass) rewrites
`fused op -> normed -> quantization` into `fxfuse::allreduce_residual_rmsnorm_fp8`
(`fxfuse.op.fp8_schema`), which returns the e4m3 values and their scales (and the normed output only
if something else reads it). A fold is decided in two steps: `fxfuse.passes.fp8_region` proves the
quantization's structure from the graph (what it reads, its ops, that rows stay apart, that its
intermediates are private, its outputs' shapes), then `fxfuse.passes.fp8_recipe_search` runs it on
probe rows and takes the `Fp8Recipe` whose reference gives its codes and scales bit for bit. Anything
else that casts the norm's output to an FP8 dtype is left alone; the reason is kept on the fused node
(`meta[FP8_REASON]`) for `fxfuse report`.
`fxfuse.passes.site_tiers` drives it site by site (`quantization_of`, then `fold`): a site whose
quantization cannot be folded, or whose norm output also feeds other code Inductor would fuse, goes to
tier (b) there instead of staying the plain fused op.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from fxfuse.op.fp8_schema import allreduce_residual_rmsnorm_fp8, allreduce_residual_rmsnorm_fp8_tensor_eps, recipe_arguments
from fxfuse.op.schema import allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes.canonical_form import VIEW, emit_node, val
from fxfuse.passes.fp8_recipe_search import Fp8Fold, find_fold
from fxfuse.passes.fp8_region import (
    NotFused, Region, casts_to_fp8_soon, depends_on, quantization_region, reshape_plan, size_readers,
)

aten = torch.ops.aten
SQUEEZE_DIMS, UNSQUEEZE = aten.squeeze.dims, aten.unsqueeze.default
#: Node meta key holding why a fused site's FP8 quantization was left out.
FP8_REASON = "fxfuse_fp8_left_out"


@dataclass(frozen=True)
class Fp8Match:
    """A fused site's quantization that the op can fold: its subgraph and what the op computes it with."""

    region: Region
    fold: Fp8Fold


def quantization_of(fused: torch.fx.Node, normed: torch.fx.Node) -> Fp8Match | None:
    """The FP8 quantization of a fused site's normed output that the op can fold, or None: none follows,
    or it cannot be folded (why is kept on the fused node, `meta[FP8_REASON]`)."""
    if not casts_to_fp8_soon(normed):
        return None
    try:
        region = quantization_region(fused, normed)
        return Fp8Match(region, find_fold(region))
    except NotFused as why:
        fused.meta[FP8_REASON] = str(why)
        return None


def quantization_nodes(normed: torch.fx.Node, match: Fp8Match) -> set[torch.fx.Node]:
    """The nodes the fold would replace: the quantization's own, and its outputs."""
    return match.region.private | {match.region.codes, match.region.scales} - {None}


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
    region, found = match.region, match.fold
    for value in (found.static_scale, found.divisor, found.clamp_bound, found.amax_bound, found.scale_bound):
        _ready_before(value, fused)
    recipe = found.recipe
    hidden = val(normed).shape[-1]
    plans = {}
    for old, shape, groups_proven in ((region.codes, list(val(normed).shape), False),
                                      (region.scales, [*val(normed).shape[:-1], recipe.groups(hidden)], True)):
        if old is not None:
            plans[old] = reshape_plan(list(val(old).shape), shape, groups_proven)
            if plans[old] is None:
                raise NotFused(f"`{old.name}` has the shape {list(val(old).shape)}, which the op's {shape} cannot be "
                               "viewed as")
    for reader in size_readers(region.private, normed):  # a size read of normed's shape: x has it
        reader.replace_input_with(reader.args[0], fused.args[0])
    others = [user for user in normed.users if user not in region.private]
    op = allreduce_residual_rmsnorm_fp8_tensor_eps if fused.target is allreduce_residual_rmsnorm_tensor_eps else allreduce_residual_rmsnorm_fp8
    norm = [fused.args[i] if len(fused.args) > i else fused.kwargs.get(name, default)
            for i, name, default in ((5, "weight_offset", 0.0), (6, "weight_in_fp32", False))]
    fields = recipe_arguments(recipe)
    args = (*fused.args[:5], *(fields.pop(name) for name in ("scaling", "group_size", "min_amax", "scale_dtype")),
            found.static_scale, bool(others), *norm, found.divisor, *(fields.pop(name) for name in (
                "min_scale", "power_of_two", "reciprocal", "saturate", "bound_after_power_of_two")),
            found.clamp_bound, fields.pop("bounds_from_graph"), found.amax_bound, found.scale_bound)
    new = emit_node(graph, op, args, before=fused, meta_from=fused)
    outputs = [emit_node(graph, operator.getitem, (new, i), before=fused, meta_from=fused) for i in range(4)]
    quantized, scales, residual_out, new_normed = outputs
    old_residual = output(fused, 1)
    if old_residual is not None:
        old_residual.replace_all_uses_with(residual_out)
    _replace(graph, region.codes, quantized, plans[region.codes])
    if region.scales is not None:
        _replace(graph, region.scales, scales, plans[region.scales])
    for user in others:
        user.replace_input_with(normed, new_normed)
    doomed = region.private | {region.codes, region.scales, normed, old_residual, fused, *outputs}
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


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new_value: torch.fx.Node, plan: tuple) -> None:
    """Make the users of `old` read `new_value`, reshaped to `old`'s shape as `plan` (`reshape_plan`) says."""
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
