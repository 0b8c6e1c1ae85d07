"""Let the fused op all-reduce in its input's memory where Inductor proves that input is dead.

The fused op's NCCL fallback must all-reduce into a buffer it may write. The functional op may not
write `x`, so it would copy `x` first: one more kernel than the unfused graph, whose all-reduce
Inductor re-inplaces into the matmul output. This pass (for Inductor only, after the fusion pass)
replaces every functional fused-op call by `auto_functionalized` of its `donate_x` twin (`x` marked
as written). Inductor's re-inplacing pass, which runs after the custom post-grad passes, then hands
the op `x` itself where `x` has no later use and aliases no graph input, and a copy elsewhere: the
same analysis it applies to its own collectives. The values of the graph do not change.

Eager-inner compiles skip this pass (nothing would re-inplace there); the graphs recorded by the
backend are those before it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from fxfuse.op.schema import DONATING_TWIN, FUSED_OPS

ARGUMENT_NAMES = ("x", "residual", "weight", "eps", "group_name")


def run(graph: torch.fx.Graph) -> int:
    """Rewrite every functional fused-op call in `graph` to its donating twin; returns how many."""
    rewritten = 0
    for op in FUSED_OPS:
        for node in list(graph.find_nodes(op="call_function", target=op)):
            kwargs = dict(zip(ARGUMENT_NAMES, node.args), **node.kwargs)
            with graph.inserting_before(node):
                wrapped = graph.call_function(auto_functionalized, (DONATING_TWIN[op],), kwargs)
            normed, residual_out = node.meta["val"]
            # the call's eager input values describe the functional call's arguments, not these
            kept = {k: v for k, v in node.meta.items() if k != "eager_input_vals"}
            wrapped.meta = {**kept, "val": (normed, residual_out, kwargs["x"].meta["val"])}
            for user in list(node.users):
                with graph.inserting_before(user):
                    replacement = graph.call_function(operator.getitem, (wrapped, user.args[1]))
                replacement.meta = dict(user.meta)
                user.replace_all_uses_with(replacement)
                graph.erase_node(user)
            graph.erase_node(node)
            rewritten += 1
    return rewritten
