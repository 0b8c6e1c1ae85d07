"""Let the fused op all-reduce in its input's memory where Inductor proves that input is dead.

The fused op's NCCL fallback must all-reduce into a buffer it may write. The functional op may not
write `x`, so it would copy `x` first: one more kernel than the unfused graph, whose all-reduce
Inductor re-inplaces into the matmul output. This pass (for Inductor only, after the fusion pass)
replaces every functional fused-op call by `auto_functionalized` of its `donate_x` twin (`x` marked
as written). Inductor's re-inplacing pass, which runs after the custom post-grad passes, then hands
the op `x` itself where `x` has no later use and aliases no graph input, and a copy elsewhere: the
same analysis it applies to its own collectives. The values of the graph do not change.

A call whose residual or weight may share memory with `x` is never donated: the kernel would
all-reduce into `x` and then read the residual (or weight) it just overwrote, and Inductor's analysis
does not see that hazard, because the reads come from the very call that writes. "May share" means
that walking back through view ops (every op whose schema says its result aliases its input, plus
`_unsafe_view`) from both arguments reaches one node; Inductor removes a user's `clone()` of `x`
before this pass runs, so a cloned residual counts as `x` itself. The kernels check for overlapping
memory too (`fxfuse.op.reference.may_overlap`), in case some later rewrite brings the two together.

The all-reduce-only op of tier (b) (`fxfuse.op.all_reduce_schema`) becomes `auto_functionalized` of its
in-place twin `all_reduce_` the same way (its users read the written `x`, output 1), so that it all-reduces
in x's memory exactly where Inductor's own all-reduce would, and on a copy elsewhere. Output 1 gets a fake
value of its own (new storage), as functionalization gives it: re-inplacing decides by storage, and a
value sharing x's storage read after the op counts as a later use of x, so Inductor would copy x first.
torch 2.13 re-derives that value before re-inplacing; torch 2.11 keeps the pass's, and there the copy made
a tier-(b) site up to 1.44x Inductor's time on an H200 (1.73x under dynamic shapes;
bench/results/fallback_nvidia-h200_20261203-034335).

Eager-inner compiles skip this pass (nothing would re-inplace there); the graphs recorded by the
backend are those before it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from fxfuse.op.all_reduce_schema import all_reduce, all_reduce_
from fxfuse.op.schema import DONATING_TWIN, FUSED_OPS
from fxfuse.passes.pattern_support import is_view

def run(graph: torch.fx.Graph) -> int:
    """Rewrite every functional fused-op call in `graph` whose `x` shares no memory with its residual
    or weight to its donating twin, and every all-reduce-only op to its in-place twin; returns how many."""
    rewritten = _donate_all_reduces(graph)
    for op in FUSED_OPS:
        for node in list(graph.find_nodes(op="call_function", target=op)):
            kwargs = dict(zip([argument.name for argument in op._schema.arguments], node.args), **node.kwargs)
            if shares_memory_with_x(kwargs):
                continue
            with graph.inserting_before(node):
                wrapped = graph.call_function(auto_functionalized, (DONATING_TWIN[op],), kwargs)
            # the call's eager input values describe the functional call's arguments, not these
            kept = {k: v for k, v in node.meta.items() if k != "eager_input_vals"}
            wrapped.meta = {**kept, "val": (*node.meta["val"], kwargs["x"].meta["val"])}
            for user in list(node.users):
                with graph.inserting_before(user):
                    replacement = graph.call_function(operator.getitem, (wrapped, user.args[1]))
                replacement.meta = dict(user.meta)
                user.replace_all_uses_with(replacement)
                graph.erase_node(user)
            graph.erase_node(node)
            rewritten += 1
    return rewritten


def _donate_all_reduces(graph: torch.fx.Graph) -> int:
    """Rewrite each `fxfuse.all_reduce(x, group)` to `auto_functionalized(all_reduce_, x=x, group_name=group)`,
    its users reading output 1 (the reduced x); returns how many."""
    nodes = list(graph.find_nodes(op="call_function", target=all_reduce))
    for node in nodes:
        x, group_name = node.args
        with graph.inserting_before(node):
            wrapped = graph.call_function(auto_functionalized, (all_reduce_,), {"x": x, "group_name": group_name})
            reduced = graph.call_function(operator.getitem, (wrapped, 1))
        kept = {k: v for k, v in node.meta.items() if k != "eager_input_vals"}
        reduced_val = x.meta["val"].clone()  # a fake tensor: new storage, x's sizes and strides
        wrapped.meta = {**kept, "val": (None, reduced_val)}
        reduced.meta = {**kept, "val": reduced_val}
        node.replace_all_uses_with(reduced)
        graph.erase_node(node)
    return len(nodes)


def shares_memory_with_x(arguments: dict) -> bool:
    """Whether the call's residual or weight may be a view of the same memory as its `x`."""
    x_base = view_base(arguments["x"])
    return any(
        isinstance(arguments[name], torch.fx.Node) and view_base(arguments[name]) is x_base
        for name in ("residual", "weight")
    )


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` views: follow view ops (and `getitem` of a multi-output view
    such as `split`) back to the first node that is not one."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, torch.fx.Node) and is_view(source):
            node = source
        elif is_view(node) and isinstance(source, torch.fx.Node):
            node = source
        else:
            break
    return node
