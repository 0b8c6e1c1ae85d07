"""Which all-reduce sites of a graph the passes fused, and why not the others: one `SiteDecision` each.

`sites_before(graph)` notes the sites before the passes run: each all-reduce, the node whose value
it reduces (a pass that erases the all-reduce clears its arguments) and every node of the graph then.
`site_decisions(graph, before, config)` follows each site into the rewritten graph, by the node it
reduced: into a fused op (tier (a)), directly or through the merge pass's new sum of partial results,
into an all-reduce-only op (tier (b), whose node keeps why the site is not fused), or to an all-reduce
left over (tier (c)), which `explain_unfused` explains once however many merged sites it holds.
`unfused_sites(decisions)` sums up those left unfused for the record (`UnfusedSites`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.fx

from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.schema import FUSED_OPS
from fxfuse.passes.config import PassConfig
from fxfuse.passes.pattern_support import ALL_REDUCE
from fxfuse.passes.site_tiers import TIER_REASON
from fxfuse.passes.unfused_reasons import explain_unfused, reason_kind
from fxfuse.rewrite.records import UnfusedSites


@dataclass(frozen=True)
class SitesBefore:
    """A graph's all-reduce sites before the passes: each all-reduce and the node it reduces, in graph
    order, and the nodes of the graph then."""

    all_reduces: tuple[torch.fx.Node, ...]
    producers: tuple[torch.fx.Node, ...]
    nodes: frozenset[torch.fx.Node]


@dataclass(frozen=True)
class SiteDecision:
    """What the passes made of one all-reduce site.

    `all_reduce`: the name of the site's all-reduce node before the passes; `producer`: the node whose
    value it reduced; `fused_into`: the fused op that now holds the site, or None; `merged`: reduced
    together with another site first (pattern 3); `reason`: why it is not fused (None when fused);
    `tier`: "a" (fused), "b" (the all-reduce-only op, add and norm left to Inductor) or "c" (Inductor's
    own all-reduce), as `fxfuse.passes.site_tiers` describes them.
    """

    all_reduce: str
    producer: torch.fx.Node
    fused_into: torch.fx.Node | None
    merged: bool
    reason: str | None
    tier: str = "c"

    @property
    def fused(self) -> bool:
        """Whether the site ended up inside a fused op."""
        return self.fused_into is not None


def sites_before(graph: torch.fx.Graph) -> SitesBefore:
    """Note `graph`'s all-reduce sites before the passes rewrite it."""
    all_reduces = tuple(graph.find_nodes(op="call_function", target=ALL_REDUCE))
    return SitesBefore(all_reduces, tuple(node.args[0] for node in all_reduces), frozenset(graph.nodes))


def site_decisions(graph: torch.fx.Graph, before: SitesBefore, config: PassConfig) -> tuple[SiteDecision, ...]:
    """One `SiteDecision` per site of `before`, in its order, read from the rewritten `graph`."""
    fused_into: dict[torch.fx.Node, torch.fx.Node] = {}
    merged: set[torch.fx.Node] = set()
    reasons: dict[torch.fx.Node, str] = {}
    for op in FUSED_OPS:
        for site in graph.find_nodes(op="call_function", target=op):
            originals = _original_inputs(site.args[0], before.nodes)
            fused_into.update(dict.fromkeys(originals, site))
            merged.update(originals if len(originals) > 1 else ())
    fast: set[torch.fx.Node] = set()
    for left in graph.find_nodes(op="call_function", target=ALL_REDUCE):
        originals = _original_inputs(left.args[0], before.nodes)
        merged.update(originals if len(originals) > 1 else ())
        reasons.update(dict.fromkeys(originals, explain_unfused(left, config)))
    for left in graph.find_nodes(op="call_function", target=all_reduce):
        originals = _original_inputs(left.args[0], before.nodes)
        merged.update(originals if len(originals) > 1 else ())
        reasons.update(dict.fromkeys(originals, left.meta.get(TIER_REASON, "no reason recorded")))
        fast.update(originals)
    return tuple(
        SiteDecision(all_reduce_node.name, producer, fused_into.get(producer), producer in merged,
                     None if producer in fused_into else reasons.get(producer, "not found in the rewritten graph"),
                     "a" if producer in fused_into else "b" if producer in fast else "c")
        for all_reduce_node, producer in zip(before.all_reduces, before.producers)
    )


def unfused_sites(decisions: tuple[SiteDecision, ...]) -> UnfusedSites | None:
    """How many sites were left unfused and the most common reason (the first site's sentence of the
    most common `reason_kind`); None if every site fused."""
    reasons = [decision.reason for decision in decisions if not decision.fused]
    if not reasons:
        return None
    kinds = Counter(reason_kind(reason) for reason in reasons)
    kind, with_reason = kinds.most_common(1)[0]
    return UnfusedSites(len(reasons), next(reason for reason in reasons if reason_kind(reason) == kind), with_reason,
                        sum(decision.tier == "b" for decision in decisions))


def _original_inputs(node: torch.fx.Node, before: frozenset[torch.fx.Node]) -> list[torch.fx.Node]:
    """`node` if it was in the graph before the passes, else the pre-pass nodes it was built from."""
    if node in before:
        return [node]
    return [original for arg in node.all_input_nodes for original in _original_inputs(arg, before)]
