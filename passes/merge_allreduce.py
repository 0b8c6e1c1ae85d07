"""Pattern 3: merge `all_reduce(a) + all_reduce(b)` on one group into `all_reduce(a + b)`.

DeepSeek's official inference code reduces the shared experts' output on its own and adds it to the
reduced routed output: two all-reduces where one suffices. After this pass the single all-reduce
feeds the residual add and RMSNorm, so pattern 1 (`allreduce_rmsnorm_fusion`) fuses it; run this pass
first. Both all-reduces must be sums over the same group (the group name is part of the traced
pattern), their results used only by the add (an add with no `alpha`), `a`, `b` of one dtype and shape
(no broadcasting), and no other collective issued between the two (the merge would change the order of
collectives). The merged all-reduce is issued where the later of the two was, never later. The sum
`a + b` is rounded to that dtype before reducing, so in bfloat16/float16 the result can differ from the
unmerged one by rounding, as in the reference implementation it imitates.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from fxfuse.passes.canonical_form import canonicalize
from fxfuse.passes.collective_placement import OriginalPlaces, collective_between
from fxfuse.passes.config import MERGE_ALLREDUCE, PassConfig
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


def mergeable_partial_sums(match: Match) -> bool:
    """extra_check: `a` and `b` are tensors of the same dtype and shape, no matched node has a keyword
    argument that changes its value (`alpha` on the add), and no collective is issued between the two
    all-reduces."""
    a = matched_tensor(match, "a")
    b = matched_tensor(match, "b")
    if a is None or b is None or a.dtype != b.dtype or not same_shape(a, b) or keyword_refusal(match.nodes):
        return False
    first, second = [node for node in match.nodes if node.target is ALL_REDUCE]
    return collective_between(first, second) is None


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
    Each merged all-reduce (and the sum it reduces) is issued where the later of its two all-reduces was
    (`collective_placement.OriginalPlaces`).
    """
    if not config.enabled(MERGE_ALLREDUCE):
        return 0
    canonicalize(graph)
    merged = 0
    for group in sum_allreduce_groups(graph):
        patterns = merge_patterns(group)
        while True:
            places = OriginalPlaces(graph)
            count = patterns.apply(graph)
            if not count:
                break
            merged += count
            for node in list(graph.find_nodes(op="call_function", target=ALL_REDUCE)):
                if node.args[2] == group and isinstance(node.args[0], torch.fx.Node):
                    places.restore(graph, node, node.args[0].args, group)
    return merged
