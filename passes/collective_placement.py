"""Keep every collective where the user issued it when a pass rewrites one.

A rewrite replaces an all-reduce by a new collective: the fused op (pattern 1/2), the all-reduce of a
merged sum (pattern 3). torch's pattern matcher inserts the replacement where the match's first output
was (the residual add, the merge add), which can come after other collectives or other work: the
collective would be issued later than written, and the order of collectives could change. The passes
therefore never move a collective later and never change the order of collectives:

- `late_input_refusal` (an extra check) refuses a site whose fused op needs, besides the all-reduced
  value, an input (residual, weight, eps) computed after the all-reduce from the site's own values
  (fusing would make a cycle) or from anything that cannot move before it (another collective, a
  mutation, a random op); `collective_between` finds a collective issued between two all-reduces that a
  merge would join.
- `OriginalPlaces` notes where each summed all-reduce was before a pass runs; `restore` then issues
  each new collective exactly there (for a merge: where the later of the two was), after moving up the
  pure computations it needs that came later (a residual or eps computed after the all-reduce).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

import torch
import torch.fx

from fxfuse.op.schema import FUSED_OPS
from fxfuse.passes.pattern_support import ALL_REDUCE, WAIT_TENSOR, op_name


def issues_collective(node: torch.fx.Node) -> bool:
    """Whether `node` starts a collective (any functional collective but a wait, or a fused op)."""
    if node.op != "call_function":
        return False
    if node.target in FUSED_OPS:
        return True
    return getattr(node.target, "namespace", None) == "_c10d_functional" and node.target is not WAIT_TENSOR


def movable_earlier(node: torch.fx.Node) -> bool:
    """Whether `node` computes a value from its inputs only, so it may run earlier in the graph: no
    collective or wait, no mutation, no random numbers."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return (target.namespace not in ("_c10d_functional", "fxfuse") and not target._schema.is_mutable
                and torch.Tag.nondeterministic_seeded not in target.tags)
    return not isinstance(target, torch._ops.HigherOrderOperator)


def late_ancestors(values: Iterable, after: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes among `values` and what they are computed from that come after `after` in graph order,
    nearest first (breadth first from `values`)."""
    found: dict[torch.fx.Node, None] = {}
    queue = deque(v for v in values if isinstance(v, torch.fx.Node) and after < v)
    while queue:
        node = queue.popleft()
        if node not in found:
            found[node] = None
            queue.extend(n for n in node.all_input_nodes if after < n)
    return list(found)


def late_input_refusal(all_reduce: torch.fx.Node, site: set[torch.fx.Node], inputs: dict[str, object]) -> str | None:
    """Why the fused op of a site cannot be issued where its `all_reduce` is: an input (`inputs`: role ->
    node or constant) computed after it from a node of `site` or from one that cannot move before it."""
    for role, value in inputs.items():
        for node in late_ancestors([value], all_reduce):
            if node in site:
                return (f"the {role} `{value.name}` is computed from `{node.name}` inside the all-reduce -> RMSNorm "
                        "chain (the fused op would need its own result)")
            if not movable_earlier(node):
                return (f"the {role} `{value.name}` is computed after the all-reduce from `{node.name}` "
                        f"({op_name(node)}), which cannot run before it: the fused op would issue the all-reduce later")
    return None


def collective_between(first: torch.fx.Node, second: torch.fx.Node) -> torch.fx.Node | None:
    """The first node between two nodes (in graph order) that issues a collective, if any."""
    if second < first:
        first, second = second, first
    node = first.next
    while node is not second:
        if issues_collective(node):
            return node
        node = node.next
    return None


class OriginalPlaces:
    """Where each summed all-reduce of a graph is issued, noted before a pass rewrites the graph."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.order = list(graph.nodes)
        self.position = {node: index for index, node in enumerate(self.order)}
        self.all_reduces: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
        self._alive: set[torch.fx.Node] | None = None  # the nodes left after the rewrite, once asked
        self._placed: list[tuple[int, torch.fx.Node]] = []  # (original position, node) of what restore put
        for node in self.order:
            if node.op == "call_function" and node.target is ALL_REDUCE and node.args[1] == "sum":
                self.all_reduces[(node.args[0], node.args[2])].append(node)

    def restore(self, graph: torch.fx.Graph, collective: torch.fx.Node, reduced: Iterable, group_name: str) -> None:
        """Issue `collective`, which replaces the all-reduces over `group_name` of the `reduced` values
        (now erased from `graph`), where the last of them was: after every node that came before it and
        is still in the graph, wherever an earlier `restore` has put it (a collective restored in the
        place of an earlier all-reduce, a node moved up with it); the nodes it needs that come later move
        up with it, in their order. Two sites with nothing left between them thus keep their order,
        whichever is restored first. No-op for a collective that was in the graph before, or if no such
        all-reduce was erased. Call it for every new collective after the rewrite has erased what they
        replace and before anything else is erased."""
        if collective in self.position:
            return
        if self._alive is None:
            self._alive = set(graph.nodes)
        alive = self._alive
        originals = [self._erased(value, group_name, alive) for value in reduced]
        originals = [node for node in originals if node is not None]
        if not originals:
            return
        last = max(self.position[node] for node in originals)
        nearest = next(node for node in reversed(self.order[:last]) if node in alive)
        before = max([nearest] + [node for place, node in self._placed if place < last])
        moved = sorted(late_ancestors(collective.all_input_nodes, before))
        self._placed += [(self.position.get(node, last), node) for node in moved] + [(last, collective)]
        cursor = before
        for node in moved + [collective]:
            if cursor.next is not node:
                cursor.append(node)
            cursor = node

    def _erased(self, value, group_name: str, alive: set[torch.fx.Node]) -> torch.fx.Node | None:
        """The first noted all-reduce of `value` over `group_name` that is no longer in the graph
        (forgotten once returned, so two rewrites of one value's all-reduces get one each)."""
        candidates = self.all_reduces.get((value, group_name), [])
        for index, node in enumerate(candidates):
            if node not in alive:
                return candidates.pop(index)
        return None

