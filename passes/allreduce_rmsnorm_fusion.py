"""Patterns 1 and 2: fuse a tensor-parallel all-reduce with the RMSNorm that follows it.

Pattern 1 (`allreduce_residual_rmsnorm`): `hidden = all_reduce(x) + residual` (either operand order)
feeding an RMSNorm, where `hidden` may also be used later as the next residual. It becomes
`normed, residual_out = fxfuse.allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)` and
every other use of `hidden` reads `residual_out`. This covers the attention output, the MLP/MoE output
(into the next layer's input norm) and the last layer (into the final norm). With a float32 residual
stream and 16-bit activations the sum is `all_reduce(x).to(float32) + residual`, normed in float32 and
cast to x's dtype: the op takes the float32 residual and returns a float32 `residual_out`.

Pattern 2 (`allreduce_rmsnorm`): `all_reduce(x)` feeding an RMSNorm directly (the vocab-parallel
embedding before the first layer's input norm). It becomes the fused op with `residual=None`, and
other uses of the all-reduced value read `residual_out`.

The graph is first rewritten into one canonical spelling (`fxfuse.passes.canonical_form`: reshapes
moved up to the chain's inputs, the all-reduced operand first in the residual add, one spelling of the
RMSNorm arithmetic), so the traced patterns below need only that spelling: the RMSNorm computed in
float32 with the weight multiplied after the cast back or in float32 before it (in float32 these are
one graph; before it, the op gets `weight_in_fp32=True`, and the weight may be float32, which
`norm_weight.take_weight_apart` turns back into the 16-bit parameter plus Gemma's offset where it can),
for bfloat16, float16 and float32 activations, with any eps (each site keeps its own).
The eps is a Python float, or a 0-dim CPU tensor when `torch.compile(dynamic=True)` made the model's
float eps a graph input; the fused call is then the op's `tensor_eps` overload, which reads it when it
runs. The patterns are traced once per process group name found in the graph, so the group name is
part of the pattern. `extra_check` refuses sites the fused op cannot reproduce (`site_refusal` says
why): dtypes that differ (the matcher ignores dtype arguments, so the norm's result is checked to
have x's dtype too), a residual or weight that is not a same-shape tensor / a hidden-size
vector, an eps tensor that is not a CPU scalar; a matched node with a keyword argument the patterns do
not name (an `alpha` on an add, a `dtype` on the mean: `keyword_refusal`); a residual, weight or eps
computed from the site's own values, or after the all-reduce from something that cannot move before it
(`collective_placement.late_input_refusal`: each fused op is issued where its all-reduce was).
`fxfuse.passes.unfused_reasons.explain_unfused` says why an all-reduce left in a rewritten graph was not
fused.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement, stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.decide.capability import fused_kernel_unavailable
from fxfuse.op.schema import FUSED_OPS, NORM_OPS, allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes.canonical_form import canonicalize, remember_chain_origins, val
from fxfuse.passes.collective_placement import OriginalPlaces, late_input_refusal
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PassConfig
from fxfuse.passes.norm_weight import take_weight_apart
from fxfuse.passes.pattern_support import (
    ALL_REDUCE,
    allreduce_sum,
    example_tensor,
    keyword_refusal,
    matched_tensor,
    same_shape,
    sum_allreduce_groups,
    trace_functional,
)

FUSIBLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The fused op's inputs besides the all-reduced value, by what a reason calls them: pattern argument names.
INPUT_ROLES = {"residual": "residual", "RMSNorm weight": "weight", "eps": "eps"}

# Traced in place of the real eps so the pattern binds each site's own eps as an argument. It must
# survive a round trip through float32 unchanged (on CPU, F.rms_norm rounds eps to float32)
# and appear nowhere else in the patterns.
EPS_PLACEHOLDER = 2.0**-20

RMSNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _normalized_fp32(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """`hidden * rsqrt(mean(hidden**2) + eps)` computed in float32, as transformers writes it."""
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return hidden * torch.rsqrt(variance + eps)


def rmsnorm_cast_times_weight(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Canonical form of transformers' LlamaRMSNorm: `normed.to(dtype) * weight`."""
    return _normalized_fp32(hidden, eps).to(hidden.dtype) * weight


def rmsnorm_cast_of_times_weight(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight applied in float32 before the cast back (`F.rms_norm`; Gemma's `(1 + w.float())` as the
    weight): `(normed * weight).to(dtype)`."""
    return (_normalized_fp32(hidden, eps) * weight).to(hidden.dtype)


@dataclass(frozen=True)
class NormSpelling:
    """What a canonical site computes beyond the plain chain: `weight_in_fp32`, the weight multiplies
    the float32 norm before the one cast back (the op's `weight_in_fp32`; the weight may be float32);
    `float32_residual`, the 16-bit all-reduced value is upcast and added to a float32 residual, the norm
    computed on that float32 sum and cast to the activations' dtype (Megatron's fp32 residual stream)."""

    weight_in_fp32: bool = False
    float32_residual: bool = False


PLAIN = NormSpelling()
WEIGHT_IN_FP32 = NormSpelling(weight_in_fp32=True)
FLOAT32_RESIDUAL = NormSpelling(weight_in_fp32=True, float32_residual=True)

# The canonical spellings whose traced graphs differ, per traced dtype: in float32 the casts vanish,
# so the weight applied before or after the cast back is one graph there. (The matcher ignores dtype
# arguments: a bfloat16 trace matches float16 sites too, `site_refusal` checks the dtypes.)
RMSNORM_SPELLINGS: dict[torch.dtype, tuple[tuple[RMSNorm, NormSpelling], ...]] = {
    torch.bfloat16: ((rmsnorm_cast_times_weight, PLAIN), (rmsnorm_cast_of_times_weight, WEIGHT_IN_FP32)),
    torch.float32: ((rmsnorm_cast_times_weight, PLAIN),),
}


def site_refusal(
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float | torch.Tensor | None,
    residual: torch.Tensor | None = None,
    with_residual: bool = False,
    spelling: NormSpelling = PLAIN,
    output_dtype: torch.dtype | None = None,
    sum_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the fused op cannot reproduce a matched site with the unfused rounding; None if it can.

    x has a supported dtype; the residual (with `with_residual`) has x's shape and dtype, or float32
    for a float32 residual stream; weight is a vector of the hidden size (x's last dimension) in x's
    dtype, or float32 where `spelling` applies it in float32; eps is a float or a 0-dim floating CPU
    tensor; the norm's result (`output_dtype`, when known) has x's dtype, which the op returns, and the
    normed sum (`sum_dtype`) the residual's.
    Anything else (a scalar or broadcast "residual", a differently-typed weight or residual, an eps on
    a GPU, which would cost a device sync to read) stays unfused.
    """
    if x is None or x.dim() < 1:
        return "the all-reduced value is not a tensor with a hidden dimension"
    if x.dtype not in FUSIBLE_DTYPES:
        return f"dtype {_dtype_name(x.dtype)} is not bfloat16, float16 or float32"
    if output_dtype is not None and output_dtype != x.dtype:
        return f"the RMSNorm's result is {_dtype_name(output_dtype)}, not the all-reduced {_dtype_name(x.dtype)} the fused op returns"
    if with_residual:
        if residual is None:
            return "the residual is not a tensor"
        wanted = torch.float32 if spelling.float32_residual else x.dtype
        if residual.dtype != wanted:
            stream = "the float32 residual stream's " if spelling.float32_residual else ""
            return f"{stream}residual dtype {_dtype_name(residual.dtype)} differs from {_dtype_name(wanted)}"
        if not same_shape(residual, x):
            return f"residual shape {list(residual.shape)} is not the all-reduced shape {list(x.shape)}"
        if sum_dtype is not None and sum_dtype != wanted:
            return f"the residual add's result is {_dtype_name(sum_dtype)}, not {_dtype_name(wanted)}"
        if spelling.float32_residual and not spelling.weight_in_fp32:
            return ("the float32 residual stream's RMSNorm is cast back before its weight multiply: the fused op "
                    "applies the weight in float32 before the cast")
    if weight is None:
        return "the RMSNorm weight is not a tensor"
    if weight.dtype != x.dtype and not (spelling.weight_in_fp32 and weight.dtype == torch.float32):
        also = " and float32" if spelling.weight_in_fp32 else ""
        return f"RMSNorm weight dtype {_dtype_name(weight.dtype)} differs from {_dtype_name(x.dtype)}{also}"
    if weight.dim() != 1 or not statically_known_true(weight.shape[0] == x.shape[-1]):
        return f"RMSNorm weight shape {list(weight.shape)} is not [hidden size {x.shape[-1]}]"
    if isinstance(eps, torch.Tensor) and (eps.dim() != 0 or not eps.is_floating_point() or eps.device.type != "cpu"):
        return f"eps is a {eps.device.type} tensor of shape {list(eps.shape)}, not a CPU scalar"
    if eps is None:
        return "eps is neither a float nor a tensor"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _matched_eps(match: Match) -> float | torch.Tensor | None:
    """The eps bound by a match: a float constant, or the fake tensor of the node that feeds it.

    torch 2.11 runs extra_check on a match of the pattern re-traced with the site's own arguments,
    where a float eps is a literal of the pattern rather than an argument: no "eps" then means a
    float constant.
    """
    if "eps" not in match.kwargs:
        return 0.0
    eps = match.kwargs["eps"]
    if isinstance(eps, (int, float)):
        return float(eps)
    return matched_tensor(match, "eps")


def kernel_refusal(x: torch.Tensor, group_name: str) -> str | None:
    """Why no fused all-reduce kernel can ever run this site (so Inductor keeps it), or None."""
    world_size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
    return fused_kernel_unavailable(x.device.type, x.dtype, world_size)


def site_blocker(
    all_reduce: torch.fx.Node, nodes, inputs: dict[str, object], eps: float | torch.Tensor | None, with_residual: bool,
    spelling: NormSpelling, result_dtypes: tuple[torch.dtype | None, torch.dtype | None], kernel_group: str | None,
) -> str | None:
    """The first reason the fused op cannot replace a site, or None: `site_refusal`, then (when
    `kernel_group` names the site's group) `kernel_refusal`, a keyword argument of `nodes` that changes
    a value (`keyword_refusal`: the matcher ignores those), and an input the op could not read where the
    all-reduce was (`late_input_refusal`). The pattern's extra check and `explain_unfused` both ask this.

    `inputs`: the residual, weight and eps by `INPUT_ROLES` role (nodes or constants); `eps`: its value
    (a float or a fake tensor); `result_dtypes`: those of the norm's result and the normed sum.
    """
    x = val(all_reduce.args[0])
    refusal = site_refusal(x, val(inputs["RMSNorm weight"]), eps, val(inputs["residual"]), with_residual, spelling,
                           *result_dtypes)
    if refusal is None and kernel_group is not None:
        refusal = kernel_refusal(x, kernel_group)
    if refusal is None:
        refusal = keyword_refusal(nodes)
    if refusal is None:
        refusal = late_input_refusal(all_reduce, set(nodes), inputs)
    return refusal


def fusible_site(match: Match, with_residual: bool, kernel_group: str | None = None, spelling: NormSpelling = PLAIN) -> bool:
    """extra_check: `site_blocker` finds nothing against the matched site.

    `with_residual` says which pattern matched (1: True, 2: False): it is not read from the match,
    whose arguments can be pattern literals on some torch versions (a scalar "residual" among them).
    """
    (all_reduce,) = [node for node in match.nodes if node.target is ALL_REDUCE]
    inputs = {role: match.kwargs.get(name) for role, name in INPUT_ROLES.items()}
    normed, hidden = (val(node) for node in match.output_nodes())
    dtypes = (normed.dtype if normed is not None else None, hidden.dtype if hidden is not None else None)
    if site_blocker(all_reduce, match.nodes, inputs, _matched_eps(match), with_residual, spelling, dtypes,
                    kernel_group) is not None:
        return False
    remember_chain_origins(all_reduce.args[0], match.nodes)  # for a site that tier (b) gives back to Inductor
    return True


def fused_call(x, residual, weight, eps, group_name: str, weight_in_fp32: bool = False):
    """The fused op for one site: the float overload, or `tensor_eps` when eps is a graph tensor."""
    op = allreduce_residual_rmsnorm_tensor_eps if isinstance(eps, torch.Tensor) else allreduce_residual_rmsnorm
    return op(x, residual, weight, eps, group_name, 0.0, weight_in_fp32)


def _register(
    pass_: PatternMatcherPass, search: Callable, replacement: Callable, examples: list[torch.Tensor], with_residual: bool,
    kernel_group: str | None, spelling: NormSpelling,
) -> None:
    """Trace `search` -> `replacement` into `pass_`, checked by `fusible_site`, eps bound per site."""
    register_replacement(
        search,
        replacement,
        examples,
        trace_functional,
        pass_,
        extra_check=functools.partial(fusible_site, with_residual=with_residual, kernel_group=kernel_group, spelling=spelling),
        scalar_workaround={"eps": EPS_PLACEHOLDER},
    )


def _register_residual_pattern(
    pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, spelling: NormSpelling, dtype: torch.dtype,
    kernel_group: str | None,
) -> None:
    """Register pattern 1 for one norm spelling and dtype (the canonical form adds the residual second)."""

    def fused(x, residual, weight, eps):
        return fused_call(x, residual, weight, eps, group_name, spelling.weight_in_fp32 and dtype != torch.float32)

    def reduced_plus_residual(x, residual, weight, eps):
        hidden = allreduce_sum(x, group_name) + residual
        return norm(hidden, weight, eps), hidden

    examples = [example_tensor(4, 16, dtype=dtype), example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)]
    _register(pass_, reduced_plus_residual, fused, examples, True, kernel_group, spelling)


def _register_float32_residual_pattern(pass_: PatternMatcherPass, group_name: str, kernel_group: str | None) -> None:
    """Register pattern 1 for a float32 residual stream: `all_reduce(x).to(float32) + residual`, normed in
    float32 with the weight, cast to x's dtype (traced in bfloat16; it matches float16 sites too)."""

    def fused(x, residual, weight, eps):
        return fused_call(x, residual, weight, eps, group_name, True)

    def reduced_upcast_plus_residual(x, residual, weight, eps):
        hidden = allreduce_sum(x, group_name).to(torch.float32) + residual
        return (_normalized_fp32(hidden, eps) * weight).to(x.dtype), hidden

    examples = [example_tensor(4, 16, dtype=torch.bfloat16), example_tensor(4, 16, dtype=torch.float32),
                example_tensor(16, dtype=torch.float32)]
    _register(pass_, reduced_upcast_plus_residual, fused, examples, True, kernel_group, FLOAT32_RESIDUAL)


def _register_plain_pattern(
    pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, spelling: NormSpelling, dtype: torch.dtype,
    kernel_group: str | None,
) -> None:
    """Register pattern 2 (no residual) for one norm spelling and dtype."""

    def fused(x, weight, eps):
        return fused_call(x, None, weight, eps, group_name, spelling.weight_in_fp32 and dtype != torch.float32)

    def reduced_into_norm(x, weight, eps):
        reduced = allreduce_sum(x, group_name)
        return norm(reduced, weight, eps), reduced

    examples = [example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)]
    _register(pass_, reduced_into_norm, fused, examples, False, kernel_group, spelling)


@functools.cache
def fusion_patterns(group_name: str, patterns: frozenset[str], fuse_without_fast_kernel: bool = False) -> PatternMatcherPass:
    """The traced patterns 1 and/or 2 (as named in `patterns`) for one process group, built once.

    Unless `fuse_without_fast_kernel`, sites where no fused all-reduce kernel can run are refused.
    """
    pass_ = PatternMatcherPass()
    kernel_group = None if fuse_without_fast_kernel else group_name
    for dtype, spellings in RMSNORM_SPELLINGS.items():
        for norm, spelling in spellings:
            if ALLREDUCE_RESIDUAL_RMSNORM in patterns:
                _register_residual_pattern(pass_, group_name, norm, spelling, dtype, kernel_group)
            if ALLREDUCE_RMSNORM in patterns:
                _register_plain_pattern(pass_, group_name, norm, spelling, dtype, kernel_group)
    if ALLREDUCE_RESIDUAL_RMSNORM in patterns:
        _register_float32_residual_pattern(pass_, group_name, kernel_group)
    return pass_


def enabled_patterns(config: PassConfig) -> frozenset[str]:
    """The names of patterns 1 and 2 that `config` enables."""
    return frozenset(p for p in (ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM) if config.enabled(p))


def run(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Replace every enabled pattern-1/2 site in `graph` (in place); returns how many were fused.

    The graph is canonicalized first (`canonical_form.canonicalize`). Each fused call is issued where
    the site's all-reduce was (`collective_placement.OriginalPlaces`; an eps or residual computed after
    the all-reduce from earlier values moves up with it), so no collective runs later or in another
    order than written. The graph is then re-sorted topologically (a no-op after that placement, kept
    as Inductor does after its post-grad passes), and unused reads of fused-op outputs are dropped.
    """
    patterns = enabled_patterns(config)
    if not patterns:
        return 0
    canonicalize(graph)
    places = OriginalPlaces(graph)
    fused = sum(fusion_patterns(group, patterns, config.fuse_without_fast_kernel).apply(graph)
                for group in sum_allreduce_groups(graph))
    if fused:
        emitted = [node for op in NORM_OPS for node in graph.find_nodes(op="call_function", target=op)]
        for node in emitted:  # every fused op in its place before take_weight_apart erases any node
            places.restore(graph, node, [node.args[0]], node.args[4])
        for node in emitted:
            take_weight_apart(node)
        stable_topological_sort(graph)
        _erase_unused_outputs(graph)
    return fused


def _erase_unused_outputs(graph: torch.fx.Graph) -> None:
    """Drop reads of fused-op outputs that nothing uses (torch 2.11 leaves some behind)."""
    for node in graph.find_nodes(op="call_function", target=operator.getitem):
        if not node.users and getattr(node.args[0], "target", None) in FUSED_OPS:
            graph.erase_node(node)
