"""Pieces shared by the pattern passes: the all-reduce spelling, tracing, and match inspection.

Functional collectives and in-place `torch.distributed.all_reduce` (which dynamo remaps to them)
both reach the post-grad graph as `_c10d_functional.all_reduce(x, "sum", group_name)` followed by
`_c10d_functional.wait_tensor`. Pattern functions call `allreduce_sum` to spell exactly that.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops
import torch.fx
from torch._inductor.pattern_matcher import Match, fwd_only
from torch.fx.experimental.symbolic_shapes import statically_known_true

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def allreduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`x` summed over the group named `group_name`, as functional collectives trace it."""
    return WAIT_TENSOR(ALL_REDUCE(x, "sum", group_name))


def sum_allreduce_groups(graph: torch.fx.Graph) -> list[str]:
    """Names of the process groups that sum all-reduces in `graph` use, sorted (same on every rank)."""
    names = {
        node.args[2]
        for node in graph.find_nodes(op="call_function", target=ALL_REDUCE)
        if node.args[1] == "sum"
    }
    return sorted(names)


def example_tensor(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor to trace a pattern function with (no data, no device, no collective runs)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def trace_functional(fn, args, **kwargs) -> torch.fx.GraphModule:
    """`fwd_only` (the pattern matcher's inference tracer), then functionalized like AOT's graphs.

    Decompositions can use in-place ops (on CPU, `F.rms_norm` adds eps with `add_`), while the
    post-grad graph is functional. Re-tracing the decomposed graph under `torch.func.functionalize`
    gives the functional form the patterns must match; a graph without in-place ops is returned as
    traced (the matcher traces every site's replacement, so this halves the pass's tracing time).
    Keyword arguments pass through to `fwd_only`.
    """
    decomposed = fwd_only(fn, args, **kwargs)
    if not any(_mutates_an_input(node) for node in decomposed.graph.nodes):
        return decomposed
    return fwd_only(torch.func.functionalize(decomposed), args, **kwargs)


def _mutates_an_input(node: torch.fx.Node) -> bool:
    """Whether `node` calls an op that writes into one of its arguments."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def matched_tensor(match: Match, name: str) -> torch.Tensor | None:
    """The fake tensor bound to pattern argument `name`, or None if a non-tensor value is bound."""
    node = match.kwargs.get(name)
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the (possibly symbolic) shapes of `a` and `b` are provably equal."""
    return a.dim() == b.dim() and all(statically_known_true(p == q) for p, q in zip(a.shape, b.shape))
