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
bfloat16, float16 and float32, with any eps (each site keeps its own). The patterns are traced from
the functions below with torch's pattern matcher, once per process group name found in the graph, so
the group name is part of the pattern. `extra_check` refuses sites the fused op cannot reproduce:
dtypes that differ, a residual or weight that is not a same-shape tensor / a hidden-size vector.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxfuse.ops import allreduce_residual_rmsnorm
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PassConfig
from fxfuse.passes.pattern_support import (
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


def fusible_site(match: Match) -> bool:
    """extra_check: the matched tensors are ones the fused op handles with the unfused rounding.

    x (and residual, if any) share a supported dtype and x's shape; weight is a vector of the hidden
    size (x's last dimension) in that dtype. Anything else (a scalar or broadcast "residual", a
    differently-typed weight or residual) stays unfused.
    """
    x = matched_tensor(match, "x")
    weight = matched_tensor(match, "weight")
    if x is None or weight is None or x.dtype not in FUSIBLE_DTYPES or x.dim() < 1:
        return False
    if "residual" in match.kwargs:
        residual = matched_tensor(match, "residual")
        if residual is None or residual.dtype != x.dtype or not same_shape(residual, x):
            return False
    return weight.dtype == x.dtype and weight.dim() == 1 and statically_known_true(weight.shape[0] == x.shape[-1])


def _register(pass_: PatternMatcherPass, search: Callable, replacement: Callable, examples: list[torch.Tensor]) -> None:
    """Trace `search` -> `replacement` into `pass_`, checked by `fusible_site`, eps bound per site."""
    register_replacement(
        search,
        replacement,
        examples,
        trace_functional,
        pass_,
        extra_check=fusible_site,
        scalar_workaround={"eps": EPS_PLACEHOLDER},
    )


def _register_residual_patterns(pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, dtype: torch.dtype) -> None:
    """Register pattern 1 for one norm spelling and dtype, with the residual on either side of `+`."""

    def fused(x, residual, weight, eps):
        return allreduce_residual_rmsnorm(x, residual, weight, eps, group_name)

    def reduced_plus_residual(x, residual, weight, eps):
        hidden = allreduce_sum(x, group_name) + residual
        return norm(hidden, weight, eps), hidden

    def residual_plus_reduced(x, residual, weight, eps):
        hidden = residual + allreduce_sum(x, group_name)
        return norm(hidden, weight, eps), hidden

    examples = [example_tensor(4, 16, dtype=dtype), example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)]
    _register(pass_, reduced_plus_residual, fused, examples)
    _register(pass_, residual_plus_reduced, fused, examples)


def _register_plain_pattern(pass_: PatternMatcherPass, group_name: str, norm: RMSNorm, dtype: torch.dtype) -> None:
    """Register pattern 2 (no residual) for one norm spelling and dtype."""

    def fused(x, weight, eps):
        return allreduce_residual_rmsnorm(x, None, weight, eps, group_name)

    def reduced_into_norm(x, weight, eps):
        reduced = allreduce_sum(x, group_name)
        return norm(reduced, weight, eps), reduced

    _register(pass_, reduced_into_norm, fused, [example_tensor(4, 16, dtype=dtype), example_tensor(16, dtype=dtype)])


@functools.cache
def fusion_patterns(group_name: str, patterns: frozenset[str]) -> PatternMatcherPass:
    """The traced patterns 1 and/or 2 (as named in `patterns`) for one process group, built once."""
    pass_ = PatternMatcherPass()
    for dtype, norms in RMSNORM_SPELLINGS.items():
        for norm in norms:
            if ALLREDUCE_RESIDUAL_RMSNORM in patterns:
                _register_residual_patterns(pass_, group_name, norm, dtype)
            if ALLREDUCE_RMSNORM in patterns:
                _register_plain_pattern(pass_, group_name, norm, dtype)
    return pass_


def run(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Replace every enabled pattern-1/2 site in `graph` (in place); returns how many were fused."""
    patterns = frozenset(p for p in (ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM) if config.enabled(p))
    if not patterns:
        return 0
    return sum(fusion_patterns(group, patterns).apply(graph) for group in sum_allreduce_groups(graph))
