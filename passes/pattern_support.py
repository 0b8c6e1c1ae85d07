"""Pieces shared by the pattern passes: the all-reduce spelling, tracing, and match inspection.

Functional collectives and in-place `torch.distributed.all_reduce` (which dynamo remaps to them)
both reach the post-grad graph as `_c10d_functional.all_reduce(x, "sum", group_name)` followed by
`_c10d_functional.wait_tensor`. Pattern functions call `allreduce_sum` to spell exactly that.

torch's pattern matcher compares only the keyword arguments a traced pattern names, and the patterns
name none: `keyword_refusal` is the check that a matched node's keyword arguments (`alpha` of an add,
`dtype` of a mean) do not change what it computes.
"""

from __future__ import annotations

from collections.abc import Iterable

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


def op_name(node: torch.fx.Node) -> str:
    """The short name of the op a node calls (`add` for `aten.add.Tensor`)."""
    target = node.target
    return getattr(getattr(target, "overloadpacket", None), "__name__", None) or getattr(target, "__name__", str(target))


def keyword_refusal(nodes: Iterable[torch.fx.Node]) -> str | None:
    """Why nodes of a matched site cannot be rewritten as the traced patterns spell them: the first
    keyword argument that changes what its node computes (`changing_keyword`), as a sentence; None if
    there is none."""
    found = changing_keyword(nodes)
    if found is None:
        return None
    node, key, value = found
    return f"`{node.name}` ({op_name(node)}) is called with {key}={value}, which the fused op does not reproduce"


def changing_keyword(nodes: Iterable[torch.fx.Node]) -> tuple[torch.fx.Node, str, object] | None:
    """(node, name, value) of the first keyword argument of `nodes` that changes what its node computes
    (an add with `alpha` other than 1, a mean with a `dtype` other than its input's), or None."""
    for node in nodes:
        for key, value in node.kwargs.items():
            if node.op == "call_function" and not _keeps_the_default(node, key, value):
                return node, key, value
    return None


def _keeps_the_default(node: torch.fx.Node, key: str, value) -> bool:
    """Whether `node`'s keyword argument `key=value` computes what leaving it out computes."""
    schema = getattr(node.target, "_schema", None)
    argument = next((a for a in schema.arguments if a.name == key), None) if schema is not None else None
    if argument is not None and argument.has_default_value() and argument.default_value == value:
        return True
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return key == "dtype" and isinstance(source, torch.Tensor) and source.dtype == value


def is_view(node: torch.fx.Node) -> bool:
    """Whether `node` calls an op whose result aliases its first argument's memory: its schema says so
    (and that it does not write it), or it is `_unsafe_view`, whose schema does not declare the alias."""
    target = node.target
    if target is torch.ops.aten._unsafe_view.default:
        return True
    schema = getattr(target, "_schema", None)
    if node.op != "call_function" or schema is None or schema.is_mutable or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write
