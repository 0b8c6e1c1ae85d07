"""Graph snapshots, op counts and readable diffs: what a pass did to an FX graph, in text.

`snapshot(graph)` freezes a graph as one readable line per node plus its op counts;
`render_diff(before, after)` shows the op counts that changed and a unified diff of the lines.
Ops are named by namespace and op without overload (`aten.add`, `_c10d_functional.all_reduce`,
`fxfuse.allreduce_residual_rmsnorm`), so counts are stable across overload choices.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx


def op_name(node: torch.fx.Node) -> str:
    """Readable name of what `node` computes: `aten.add`, `getitem`, `placeholder`, ..."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def op_counts(graph: torch.fx.Graph) -> Counter[str]:
    """How many call nodes of each op (by `op_name`) `graph` has."""
    return Counter(op_name(n) for n in graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def _describe_value(node: torch.fx.Node) -> str:
    """`  # bfloat16[s0, 64]`-style summary of node.meta["val"] (empty if absent)."""
    values = node.meta.get("val")
    if values is None:
        return ""
    parts = []
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            parts.append(f"{dtype}[{', '.join(str(s) for s in value.shape)}]")
        else:
            parts.append(repr(value))
    return "  # " + ", ".join(parts)


def _format_node(node: torch.fx.Node) -> str:
    """One readable line: `name = op(args)  # dtype[shape]`."""
    if node.op == "placeholder":
        return f"{node.name} = input{_describe_value(node)}"
    if node.op == "output":
        return f"return {node.args[0]}"
    args = ", ".join([repr(a) for a in node.args] + [f"{k}={v!r}" for k, v in node.kwargs.items()])
    return f"{node.name} = {op_name(node)}({args}){_describe_value(node)}"


@dataclass(frozen=True)
class GraphSnapshot:
    """A frozen, readable copy of a graph: one line per node and the op counts."""

    lines: tuple[str, ...]
    op_counts: Counter[str]

    def text(self) -> str:
        """The graph, one node per line."""
        return "\n".join(self.lines) + "\n"


def snapshot(graph: torch.fx.Graph) -> GraphSnapshot:
    """Freeze `graph` as it is now (later changes to the graph do not affect the snapshot)."""
    return GraphSnapshot(lines=tuple(_format_node(n) for n in graph.nodes), op_counts=op_counts(graph))


def render_diff(before: GraphSnapshot, after: GraphSnapshot) -> str:
    """Readable report of the change: the op counts that changed, then a unified diff of the nodes."""
    changed = sorted(op for op in set(before.op_counts) | set(after.op_counts) if before.op_counts[op] != after.op_counts[op])
    if not changed and before.lines == after.lines:
        return "graphs are identical\n"
    width = max((len(op) for op in changed), default=2)
    table = [f"{'op':<{width}}  before  after"] + [
        f"{op:<{width}}  {before.op_counts[op]:>6}  {after.op_counts[op]:>5}" for op in changed
    ]
    diff = difflib.unified_diff(before.lines, after.lines, "before", "after", lineterm="")
    return "\n".join(table) + "\n\n" + "\n".join(diff) + "\n"
