"""Graph snapshots, op counts and readable diffs: what a pass did to an FX graph, in text.

`snapshot(graph)` freezes a graph as one readable line per node plus its op counts;
`render_diff(before, after)` shows the op counts that changed and a unified diff of the lines.
Ops are named by namespace and op without overload (`aten.add`, `_c10d_functional.all_reduce`,
`fxfuse.allreduce_residual_rmsnorm`), so counts are stable across overload choices.

Node and symbol names in the text are stable: a node is `<op>_<k>` (the k-th node of that op in graph
order; placeholders are `arg_<k>`) and a size symbol is `s<k>` / `u<k>` by first appearance, so the
text does not depend on the names torch's tracers happen to pick. `snapshot(graph, previous=before)`
keeps the names `before` gave to nodes that are still there, and numbers new nodes after them, so a
diff shows only what a pass changed.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass, field

import sympy
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


def _name_base(node: torch.fx.Node) -> str:
    """What a node's stable name starts with: `arg` for placeholders, else the op without namespace."""
    if node.op == "placeholder":
        return "arg"
    return op_name(node).rsplit(".", 1)[-1]


def stable_names(graph: torch.fx.Graph, known: dict[torch.fx.Node, str] | None = None) -> dict[torch.fx.Node, str]:
    """`<base>_<k>` for every node, numbered per base in graph order; nodes in `known` keep their name
    and new nodes are numbered after the highest number `known` used for their base."""
    names = dict(known or {})
    next_index: Counter[str] = Counter()
    for name in names.values():
        base, _, index = name.rpartition("_")
        next_index[base] = max(next_index[base], int(index) + 1)
    for node in graph.nodes:
        if node not in names:
            base = _name_base(node)
            names[node] = f"{base}_{next_index[base]}"
            next_index[base] += 1
    return names


def _symbols_of(value) -> list:
    """Free symbols of a SymInt/SymFloat, or of a tensor's sizes, sorted by name."""
    if isinstance(value, torch.Tensor):
        return [sym for size in value.shape for sym in _symbols_of(size)]
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return sorted(value.node.expr.free_symbols, key=str)
    return []


def stable_symbols(graph: torch.fx.Graph, known: dict | None = None) -> dict:
    """Size symbol -> `s<k>` (`u<k>` for unbacked ones), numbered by first appearance in node order."""
    symbols = dict(known or {})
    for node in graph.nodes:
        values = node.meta.get("val")
        for value in values if isinstance(values, (tuple, list)) else (values,):
            for sym in _symbols_of(value):
                if sym not in symbols:
                    prefix = "u" if str(sym).startswith("u") else "s"
                    symbols[sym] = f"{prefix}{sum(1 for name in symbols.values() if name[0] == prefix)}"
    return symbols


def _describe_value(node: torch.fx.Node, symbols: dict) -> str:
    """`  # bfloat16[s0, 64]`-style summary of node.meta["val"] (empty if absent)."""
    values = node.meta.get("val")
    if values is None:
        return ""

    def size(value) -> str:
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            return str(value.node.expr.xreplace({sym: sympy.Symbol(name) for sym, name in symbols.items()}))
        return str(value)

    parts = []
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            parts.append(f"{dtype}[{', '.join(size(s) for s in value.shape)}]")
        elif isinstance(value, (torch.SymInt, torch.SymFloat)):
            parts.append(size(value))
        else:
            parts.append(repr(value))
    return "  # " + ", ".join(parts)


def _render_arg(arg, names: dict[torch.fx.Node, str]) -> str:
    """An argument as source text, nodes by their stable name."""
    if isinstance(arg, torch.fx.Node):
        return names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_render_arg(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_render_arg(v, names)}" for k, v in arg.items()) + "}"
    return re.sub(r" at 0x[0-9a-f]+", "", repr(arg))


def _format_node(node: torch.fx.Node, names: dict[torch.fx.Node, str], symbols: dict) -> str:
    """One readable line: `name = op(args)  # dtype[shape]`."""
    if node.op == "placeholder":
        return f"{names[node]} = input{_describe_value(node, symbols)}"
    if node.op == "output":
        return f"return {_render_arg(node.args[0], names)}"
    args = [_render_arg(a, names) for a in node.args] + [f"{k}={_render_arg(v, names)}" for k, v in node.kwargs.items()]
    return f"{names[node]} = {op_name(node)}({', '.join(args)}){_describe_value(node, symbols)}"


@dataclass(frozen=True)
class GraphSnapshot:
    """A frozen, readable copy of a graph: one line per node, the op counts, and the names it used."""

    lines: tuple[str, ...]
    op_counts: Counter[str]
    names: dict[torch.fx.Node, str] = field(default_factory=dict, compare=False, repr=False)
    symbols: dict = field(default_factory=dict, compare=False, repr=False)

    def text(self) -> str:
        """The graph, one node per line."""
        return "\n".join(self.lines) + "\n"


def snapshot(graph: torch.fx.Graph, previous: GraphSnapshot | None = None) -> GraphSnapshot:
    """Freeze `graph` as it is now, with stable names (those of `previous` for nodes it named).

    Later changes to the graph do not affect the snapshot's text.
    """
    names = stable_names(graph, previous.names if previous else None)
    symbols = stable_symbols(graph, previous.symbols if previous else None)
    return GraphSnapshot(
        lines=tuple(_format_node(n, names, symbols) for n in graph.nodes),
        op_counts=op_counts(graph),
        names=names,
        symbols=symbols,
    )


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
