"""Checks that the fxfuse passes keep the order and place of every collective in a graph.

`CollectiveOrder.record(graph)` notes, before the passes run, the graph's nodes in order and its
collectives (all-reduce, reduce-scatter, all-gather, ...), each keyed by its kind, reduce op and group;
a fused op counts as the summed all-reduce over its group that it issues. `check(graph)` then asserts,
on the rewritten graph:

- each collective stands for original ones: itself if it was there before; else those whose input
  its input is built from by nodes the passes made (`x` for a fused op of `x` or `view(x)`, `a` and
  `b` for the all-reduce of `a + b` that merged `all_reduce(a) + all_reduce(b)`), of its own key;
- listing, for each collective in graph order, the originals it stands for gives the old sequence
  exactly (none lost, none twice, the order kept);
- no rewritten collective is issued later than its (last) original: every node now before it that
  came after that original is one it needs (its input or computed for it: a fused op waits for its
  residual, which may then run before a collective that followed the original; the fused op, which
  completes its all-reduce before the next node, delays that collective anyway).

`OrderCheckedBackend` is an `FxfuseBackend` that runs the check on every graph it rewrites and keeps the
rewritten graphs; `compiled_like_eager` compiles a program with it and asserts its fused and merged
counts and that its outputs equal eager exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._functorch.config
import torch._inductor.config
import torch.fx
from toy_graphs import compile_and_run

from fxfuse.backend import FxfuseBackend
from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.schema import FUSED_OPS

WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
ALL_REDUCE_KEY = "_c10d_functional.all_reduce"


def collective_key(node: torch.fx.Node) -> tuple | None:
    """(kind, string arguments) of a collective node (None for any other node); a fused op is keyed as
    the summed all-reduce over its group."""
    if node.op != "call_function":
        return None
    if node.target in FUSED_OPS:
        return (ALL_REDUCE_KEY, ("sum", node.args[4]))
    if node.target is all_reduce:  # tier (b)'s all-reduce-only op
        return (ALL_REDUCE_KEY, ("sum", node.args[1]))
    if getattr(node.target, "namespace", None) != "_c10d_functional" or node.target is WAIT_TENSOR:
        return None
    name = node.target._schema.name.split("::")[-1].removesuffix("_")
    return (f"_c10d_functional.{name}", tuple(arg for arg in node.args if isinstance(arg, str)))


def collectives(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The collective nodes of `graph`, in graph order."""
    return [node for node in graph.nodes if collective_key(node) is not None]


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node `node` is computed from."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


class CollectiveOrder:
    """The order of a graph's nodes and collectives before the passes (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.position = {node: index for index, node in enumerate(graph.nodes)}
        self.collectives = collectives(graph)
        self.inputs = {node: node.args[0] for node in self.collectives}
        self.keys = {node: collective_key(node) for node in self.collectives}
        self.text = str(graph)

    @classmethod
    def record(cls, graph: torch.fx.Graph) -> CollectiveOrder:
        """Note `graph`'s order before the passes change it."""
        return cls(graph)

    def check(self, graph: torch.fx.Graph) -> None:
        """Assert the rewritten `graph` issues the recorded collectives in order, and no rewritten one later."""
        stands_for = {node: self._originals(node) for node in collectives(graph)}
        listed = [old for node in stands_for for old in stands_for[node]]
        assert listed == self.collectives, self._explain(
            graph, "the collectives now stand for " + ", ".join(
                f"`{node.name}` -> {[old.name for old in olds]}" for node, olds in stands_for.items())
            + f"; before: {[old.name for old in self.collectives]}")
        now = {node: index for index, node in enumerate(graph.nodes)}
        for node, olds in stands_for.items():
            if olds == [node]:
                continue  # not rewritten: its place among the other collectives was checked above
            needed = ancestors(node)
            moved_past = [other.name for other in graph.nodes if other in self.position and now[other] < now[node]
                          and self.position[other] > self.position[olds[-1]] and other not in needed]
            assert not moved_past, self._explain(
                graph, f"`{node.name}` (was `{olds[-1].name}`) is now issued after {moved_past}, which came "
                "after it and which it does not need")

    def _originals(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The recorded collectives `node` stands for, in their old order."""
        if node in self.position:
            return [node]
        frontier, stack, seen = set(), [node.args[0]], set()
        while stack:  # the old nodes that the passes' new nodes build node's input from
            value = stack.pop()
            if not isinstance(value, torch.fx.Node) or value in seen:
                continue
            seen.add(value)
            if value in self.position:
                frontier.add(value)
            else:
                stack.extend(value.all_input_nodes)
        key = collective_key(node)
        return [old for old in self.collectives if self.inputs[old] in frontier and self.keys[old] == key]

    def _explain(self, graph: torch.fx.Graph, what: str) -> str:
        return f"{what}\nbefore:{self.text}\nafter:{graph}"


class OrderCheckedBackend(FxfuseBackend):
    """An `FxfuseBackend` that checks every graph it rewrites with `CollectiveOrder`; `graphs` holds each
    rewritten GraphModule (under Inductor, before the donation pass). It compiles without Inductor's
    FX graph and AOTAutograd caches, whose hits would run no pass, so nothing would be checked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return super().__call__(gm, example_inputs)

    def rewrite(self, graph: torch.fx.Graph) -> None:
        order = CollectiveOrder.record(graph)
        super().rewrite(graph)
        order.check(graph)
        self.graphs.append(graph.owning_module)


def compiled_like_eager(fn, *args, fused=0, merged=0, **compile_kwargs):
    """Compile `fn` (collective order checked), assert the fused and merged counts and that every output
    equals eager exactly (dtype included); return the rewritten graph."""
    backend, outputs = compile_and_run(fn, *args, backend=OrderCheckedBackend(inner="eager"), **compile_kwargs)
    ((gm,), (record,)) = backend.graphs, backend.records
    assert (record.stats.fused, record.stats.merged) == (fused, merged)
    gm.graph.lint()
    expected = fn(*args)
    for got, want in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                         expected if isinstance(expected, tuple) else (expected,), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return gm
