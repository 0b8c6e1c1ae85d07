"""Patterns 1 and 2: fuse a tensor-parallel all-reduce with the RMSNorm that follows it.

Pattern 1 (`allreduce_residual_rmsnorm`): `hidden = all_reduce(x) + residual` (either operand order)
feeding an RMSNorm, where `hidden` may also be used later as the next residual. It becomes
`normed, residual_out = fxfuse.allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)` and
every other use of `hidden` reads `residual_out`. This covers the attention output, the MLP/MoE output
(into the next layer's input norm) and the last layer (into the final norm).

Pattern 2 (`allreduce_rmsnorm`): `all_reduce(x)` feeding an RMSNorm directly (the vocab-parallel
embedding before the first layer's input norm). It becomes the fused op with `residual=None`, and
other uses of the all-reduced value read `residual_out`.

RMSNorm spellings matched: by hand as transformers writes it (float32 upcast, pow/mean/rsqrt; the
weight multiplied after the cast back or in float32 before it, on either side) and `F.rms_norm`, in
bfloat16, float16 and float32, with any eps (each site keeps its own). The eps is a Python float, or
a 0-dim CPU tensor when `torch.compile(dynamic=True)` made the model's float eps a graph input; the
fused call is then the op's `tensor_eps` overload, which reads it when it runs. The patterns are
traced from the functions below with torch's pattern matcher, once per process group name found in
the graph, so the group name is part of the pattern. `extra_check` refuses sites the fused op cannot
reproduce (`site_refusal` says why): dtypes that differ, a residual or weight that is not a
same-shape tensor / a hidden-size vector, an eps tensor that is not a CPU scalar.
`explain_unfused(node, config)` says why an all-reduce left in a rewritten graph was not fused.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from torch._inductor.pattern_matcher import (
    Match,
    PatternExpr,
    PatternMatcherPass,
    fx_to_pattern,
    is_match,
    register_replacement,
    stable_topological_sort,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.op.capability import fused_kernel_unavailable
from fxfuse.op.schema import FUSED_OPS, allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PassConfig
from fxfuse.passes.pattern_support import (
    WAIT_TENSOR,
    allreduce_sum,
    example_tensor,
    matched_tensor,
    same_shape,
    sum_allreduce_groups,
    trace_functional,
)

FUSIBLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

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


def rmsnorm_weight_times_cast(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: `weight * normed.to(dtype)`."""
    return weight * _normalized_fp32(hidden, eps).to(hidden.dtype)


def rmsnorm_cast_times_weight(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`normed.to(dtype) * weight` (gpt-fast style operand order)."""
    return _normalized_fp32(hidden, eps).to(hidden.dtype) * weight


def rmsnorm_cast_of_times_weight(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight applied in float32 before the cast back: `(normed * weight).to(dtype)`."""
    return (_normalized_fp32(hidden, eps) * weight).to(hidden.dtype)


def rmsnorm_cast_of_weight_times(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight applied in float32 before the cast back: `(weight * normed).to(dtype)`."""
    return (weight * _normalized_fp32(hidden, eps)).to(hidden.dtype)


def rmsnorm_functional(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch.nn.functional.rms_norm` over the last dimension."""
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


# Spellings whose traced graphs differ, per traced dtype: in float32 the casts vanish, so the weight
# applied before or after the cast back is the same graph there.
RMSNORM_SPELLINGS: dict[torch.dtype, tuple[RMSNorm, ...]] = {
    torch.bfloat16: (
        rmsnorm_weight_times_cast,
        rmsnorm_cast_times_weight,
        rmsnorm_cast_of_times_weight,
        rmsnorm_cast_of_weight_times,
        rmsnorm_functional,
    ),
    torch.float32: (rmsnorm_weight_times_cast, rmsnorm_cast_times_weight, rmsnorm_functional),
}


def site_refusal(
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float | torch.Tensor | None,
    residual: torch.Tensor | None = None,
    with_residual: bool = False,
) -> str | None:
    """Why the fused op cannot reproduce a matched site with the unfused rounding; None if it can.

    x (and residual, with `with_residual`) share a supported dtype and x's shape; weight is a vector
    of the hidden size (x's last dimension) in that dtype; eps is a float or a 0-dim floating CPU
    tensor. Anything else (a scalar or broadcast "residual", a differently-typed weight or residual,
    an eps on a GPU, which would cost a device sync to read) stays unfused.
    """
    if x is None or x.dim() < 1:
        return "the all-reduced value is not a tensor with a hidden dimension"
    if x.dtype not in FUSIBLE_DTYPES:
        return f"dtype {_dtype_name(x.dtype)} is not bfloat16, float16 or float32"
    if with_residual:
        if residual is None:
            return "the residual is not a tensor"
        if residual.dtype != x.dtype:
            return f"residual dtype {_dtype_name(residual.dtype)} differs from {_dtype_name(x.dtype)}"
        if not same_shape(residual, x):
            return f"residual shape {list(residual.shape)} is not the all-reduced shape {list(x.shape)}"
    if weight is None:
        return "the RMSNorm weight is not a tensor"
    if weight.dtype != x.dtype:
        return f"RMSNorm weight dtype {_dtype_name(weight.dtype)} differs from {_dtype_name(x.dtype)}"
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


def fusible_site(match: Match, with_residual: bool, kernel_group: str | None = None) -> bool:
    """extra_check: the matched site is one the fused op reproduces (`site_refusal` is None) and, when
    `kernel_group` names the site's group, one where a fused all-reduce kernel can run (`kernel_refusal`).

    `with_residual` says which pattern matched (1: True, 2: False): it is not read from the match,
    whose arguments can be pattern literals on some torch versions (a scalar "residual" among them).
    """
    x = matched_tensor(match, "x")
    refusal = site_refusal(x, matched_tensor(match, "weight"), _matched_eps(match), matched_tensor(match, "residual"), with_residual)
    if refusal is None and kernel_group is not None:
        refusal = kernel_refusal(x, kernel_group)
    return refusal is None


def fused_call(x, residual, weight, eps, group_name: str):
    """The fused op for one site: the float overload, or `tensor_eps` when eps is a graph tensor."""
    if isinstance(eps, torch.Tensor):
        return allreduce_residual_rmsnorm_tensor_eps(x, residual, weight, eps, group_name)
    return allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)


def _register(
    pass_: PatternMatcherPass, search: Callable, replacement: Callable, examples: list[torch.Tensor], with_residual: bool,
    kernel_group: str | None,
) -> None:
    """Trace `search` -> `replacement` into `pass_`, checked by `fusible_site`, eps bound per site."""
    register_replacement(
        search,
        replacement,
        examples,
        trace_functional,
        pass_,
        extra_check=functools.partial(fusible_site, with_residual=with_residual, kernel_group=kernel_group),
        scalar_workaround={"eps": EPS_PLACEHOLDER},
    )


def _register_residual_patterns(
    pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, dtype: torch.dtype, kernel_group: str | None
) -> None:
    """Register pattern 1 for one norm spelling and dtype, with the residual on either side of `+`."""

    def fused(x, residual, weight, eps):
        return fused_call(x, residual, weight, eps, group_name)

    def reduced_plus_residual(x, residual, weight, eps):
        hidden = allreduce_sum(x, group_name) + residual
        return norm(hidden, weight, eps), hidden

    def residual_plus_reduced(x, residual, weight, eps):
        hidden = residual + allreduce_sum(x, group_name)
        return norm(hidden, weight, eps), hidden

    examples = [example_tensor(4, 16, dtype=dtype), example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)]
    _register(pass_, reduced_plus_residual, fused, examples, True, kernel_group)
    _register(pass_, residual_plus_reduced, fused, examples, True, kernel_group)


def _register_plain_pattern(
    pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, dtype: torch.dtype, kernel_group: str | None
) -> None:
    """Register pattern 2 (no residual) for one norm spelling and dtype."""

    def fused(x, weight, eps):
        return fused_call(x, None, weight, eps, group_name)

    def reduced_into_norm(x, weight, eps):
        reduced = allreduce_sum(x, group_name)
        return norm(reduced, weight, eps), reduced

    examples = [example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)]
    _register(pass_, reduced_into_norm, fused, examples, False, kernel_group)


@functools.cache
def fusion_patterns(group_name: str, patterns: frozenset[str], fuse_without_fast_kernel: bool = False) -> PatternMatcherPass:
    """The traced patterns 1 and/or 2 (as named in `patterns`) for one process group, built once.

    Unless `fuse_without_fast_kernel`, sites where no fused all-reduce kernel can run are refused.
    """
    pass_ = PatternMatcherPass()
    kernel_group = None if fuse_without_fast_kernel else group_name
    for dtype, norms in RMSNORM_SPELLINGS.items():
        for norm in norms:
            if ALLREDUCE_RESIDUAL_RMSNORM in patterns:
                _register_residual_patterns(pass_, group_name, norm, dtype, kernel_group)
            if ALLREDUCE_RMSNORM in patterns:
                _register_plain_pattern(pass_, group_name, norm, dtype, kernel_group)
    return pass_


def enabled_patterns(config: PassConfig) -> frozenset[str]:
    """The names of patterns 1 and 2 that `config` enables."""
    return frozenset(p for p in (ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM) if config.enabled(p))


def run(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Replace every enabled pattern-1/2 site in `graph` (in place); returns how many were fused.

    A fused call goes where the site's residual add (or all-reduce) was, which can come before the
    node computing an eps tensor; the graph is then re-sorted topologically, keeping the order of
    everything else (as Inductor does after its post-grad passes), and unused reads of fused-op
    outputs are dropped.
    """
    patterns = enabled_patterns(config)
    if not patterns:
        return 0
    fused = sum(fusion_patterns(group, patterns, config.fuse_without_fast_kernel).apply(graph)
                for group in sum_allreduce_groups(graph))
    if fused:
        stable_topological_sort(graph)
        _erase_unused_outputs(graph)
    return fused


def _erase_unused_outputs(graph: torch.fx.Graph) -> None:
    """Drop reads of fused-op outputs that nothing uses (torch 2.11 leaves some behind)."""
    for node in graph.find_nodes(op="call_function", target=operator.getitem):
        if not node.users and getattr(node.args[0], "target", None) in FUSED_OPS:
            graph.erase_node(node)


# ---------------------------------------------------------------- why a site stayed unfused

#: How far below the all-reduce (or its residual add) `explain_unfused` looks for an RMSNorm's output.
NORM_SEARCH_DEPTH = 12


@functools.cache
def _norm_patterns(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> tuple[PatternExpr, ...]:
    """Each RMSNorm spelling alone, traced for these dtypes, with `hidden`, `weight`, `eps` as its
    arguments; exact patterns (dtypes, dims and exponents must match, unlike the passes' generic
    first-stage patterns), so a match is an RMSNorm over the last dimension computed in float32."""
    examples = [example_tensor(4, 16, dtype=hidden_dtype), example_tensor(16, dtype=weight_dtype), EPS_PLACEHOLDER]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # F.rms_norm warns about the mixed dtypes it traces here
        # the bfloat16 list has every spelling (in float32 some trace to the same graph)
        traced = [trace_functional(norm, examples) for norm in RMSNORM_SPELLINGS[torch.bfloat16]]
    return tuple(
        fx_to_pattern(graph, argnames=("hidden", "weight", "eps"), scalar_workaround={"eps": EPS_PLACEHOLDER})
        for graph in traced
    )


def _norm_of(hidden: torch.fx.Node) -> Match | None:
    """A recognised RMSNorm of `hidden` (weight in its dtype or float32) computed below it, if any."""
    value = _val(hidden)
    if value is None:
        return None
    patterns = _norm_patterns(value.dtype, value.dtype) + _norm_patterns(value.dtype, torch.float32)
    frontier, seen = [hidden], {hidden}
    for _ in range(NORM_SEARCH_DEPTH):
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen.update(frontier)
        for node in frontier:
            for pattern in patterns:
                match = pattern.match(node)
                if is_match(match) and match.kwargs.get("hidden") is hidden:
                    return match
    return None


def _val(arg) -> torch.Tensor | None:
    """The fake tensor a graph node computes (None for a non-tensor or a literal)."""
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def explain_unfused(all_reduce: torch.fx.Node, config: PassConfig) -> str:
    """Why `run` left this `_c10d_functional.all_reduce` node unfused, in a few words.

    It looks for the RMSNorm that the all-reduced value (pattern 2) or its residual add (pattern 1)
    feeds, then gives the first refusal: not a sum, no RMSNorm follows, pattern disabled, a
    `site_refusal` (dtype, residual, weight, eps), or a value inside the chain used elsewhere.
    """
    reduce_op = all_reduce.args[1]
    if reduce_op != "sum":
        return f"reduces with {reduce_op!r}, not a sum"
    waits = list(all_reduce.users)
    if len(waits) != 1 or waits[0].target is not WAIT_TENSOR:
        return "its result is not read through one wait_tensor"
    reduced = waits[0]
    x = _val(all_reduce.args[0])
    candidates = [(reduced, None, ALLREDUCE_RMSNORM)] + [
        (add, add.args[1] if add.args[0] is reduced else add.args[0], ALLREDUCE_RESIDUAL_RMSNORM)
        for add in reduced.users
        if add.target is torch.ops.aten.add.Tensor
    ]
    refusals = []
    for hidden, residual, pattern in candidates:
        norm = _norm_of(hidden)
        if norm is None:
            continue
        if not config.enabled(pattern):
            refusals.append(f"pattern {pattern} is disabled")
            continue
        with_residual = pattern == ALLREDUCE_RESIDUAL_RMSNORM
        eps = norm.kwargs.get("eps")
        eps = eps if isinstance(eps, float) else _val(eps)
        refusal = site_refusal(x, _val(norm.kwargs.get("weight")), eps, _val(residual), with_residual)
        if refusal is None and not config.fuse_without_fast_kernel:
            refusal = kernel_refusal(x, all_reduce.args[2])
        if refusal is None and with_residual and len(reduced.users) > 1:
            refusal = "the all-reduced value is also used apart from the residual add"
        refusals.append(refusal or "a value inside the all-reduce -> add -> RMSNorm chain is also used elsewhere")
    if not refusals:
        return "no RMSNorm follows" + (" the all-reduce or its residual add" if len(candidates) > 1 else "")
    return refusals[0]
