"""Pattern 3: merge `all_reduce(a) + all_reduce(b)` on one group into `all_reduce(a + b)`.

DeepSeek's official inference code reduces the shared experts' output on its own and adds it to the
reduced routed output: two all-reduces where one suffices. After this pass the single all-reduce
feeds the residual add and RMSNorm, so pattern 1 (`allreduce_rmsnorm_fusion`) fuses it; run this pass
first. Both all-reduces must be sums over the same group (the group name is part of the traced
pattern), their results used only by the add, and `a`, `b` of one dtype and shape (no broadcasting).
The sum `a + b` is rounded to that dtype before reducing, so in bfloat16/float16 the result can
differ from the unmerged one by rounding, as in the reference implementation it imitates.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from fxfuse.passes.canonical_form import canonicalize
from fxfuse.passes.config import MERGE_ALLREDUCE, PassConfig
from fxfuse.passes.pattern_support import (
    allreduce_sum,
    example_tensor,
    matched_tensor,
    same_shape,
    sum_allreduce_groups,
    trace_functional,
)


def mergeable_partial_sums(match: Match) -> bool:
    """extra_check: `a` and `b` are tensors of the same dtype and shape."""
    a = matched_tensor(match, "a")
    b = matched_tensor(match, "b")
    return a is not None and b is not None and a.dtype == b.dtype and same_shape(a, b)


@functools.cache
def merge_patterns(group_name: str) -> PatternMatcherPass:
    """The traced pattern 3 for one process group, built once."""

    def two_allreduces(a, b):
        return allreduce_sum(a, group_name) + allreduce_sum(b, group_name)

    def one_allreduce(a, b):
        return allreduce_sum(a + b, group_name)

    pass_ = PatternMatcherPass()
    register_replacement(
        two_allreduces,
        one_allreduce,
        [example_tensor(4, 16, dtype=torch.float32), example_tensor(4, 16, dtype=torch.float32)],
        trace_functional,
        pass_,
        extra_check=mergeable_partial_sums,
    )
    return pass_


def run(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Merge every pair of summed all-reduces in `graph` (in place); returns how many merges.

    The graph is canonicalized first (`canonical_form.canonicalize`), which moves reshapes between
    the all-reduces and their sum up to the all-reduces' inputs: `view(ar(a)) + ar(b)` merges into
    `ar(view(a) + b)`. Repeats until nothing changes, so `ar(a) + ar(b) + ar(c)` becomes one all-reduce.
    """
    if not config.enabled(MERGE_ALLREDUCE):
        return 0
    canonicalize(graph)
    merged = 0
    for group in sum_allreduce_groups(graph):
        patterns = merge_patterns(group)
        while count := patterns.apply(graph):
            merged += count
    return merged
