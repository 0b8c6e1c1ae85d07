"""What one fxfuse pass run did to a graph (`FusionStats`, `UnfusedSites`, `CompileRecord`), and how
that record outlives Inductor's caches.

Inductor's FX graph cache and AOTAutograd cache key on the post-grad pass's `uuid()`
(`fxfuse.post_grad`). On a hit Inductor loads the compiled graph and runs no post-grad pass: the
fxfuse passes never see the graph, yet `FxfuseBackend.records`, `fusion_summary` and
`counters["fxfuse"]` must still say what it contains. How the record gets there:

- A mark in Inductor's own counter deltas. Every graph Inductor compiles keeps the changes its
  compile made to `counters["inductor"]`, and Inductor adds them again on every hit, from the FX
  graph cache and from the AOTAutograd cache alike (`FxGraphCache.cache_hit_post_compile`). So each
  pass run adds one counter, `mark_name(...)`: `fxfuse:` then a JSON object with the run's stats,
  whether its fused ops take CUDA tensors (the C++ fallback is installed for those), the digest
  of its snapshots and its `UnfusedSites` (so that a hit warns as the compile did,
  `fxfuse.rewrite.log`). When Inductor adds a mark back for a graph it loaded, the configured
  `FusionPostGradPass` hears of it (`fxfuse.post_grad.MarkWatchingCounter`) and turns it back into a record.
- The snapshots (the graph before and after, up to megabytes of text for a large model) in a side
  file, `<Inductor cache dir>/fxfuse/<digest>.json`, named by the digest of its content: ranks and
  graphs that compiled alike share one file. Without it (another cache directory, a remote cache,
  a deleted file) a record still has its stats, `before`/`after` are None.

Rejected: a side file keyed by Inductor's cache key (the pass never learns that key, and nothing of
fxfuse that could see it runs on an AOTAutograd hit); reading the fused ops from the generated code
(it holds what is left after the passes, not the all-reduces before them or the merges, and an
AOTAutograd hit hands no code object to the backend); counting what the compiled module calls (known
only once it runs, and a cost on every call).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.fx
from torch._dynamo.utils import counters

from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.fp8_schema import FP8_OPS
from fxfuse.op.schema import FUSED_OPS
from fxfuse.rewrite.graph_diff import GraphSnapshot, render_diff

ALL_REDUCE_OP = "_c10d_functional.all_reduce"
#: How the counters fxfuse adds to `counters["inductor"]` start (one per rewritten graph).
MARK_PREFIX = "fxfuse:"


@dataclass(frozen=True)
class FusionStats:
    """What one pass run found and did.

    `allreduces_before`/`allreduces_after`: all-reduce nodes in the graph before/after the passes;
    `merged`: pairs merged by pattern 3; `fused_with_residual`/`fused_without_residual`: fused-op
    sites of pattern 1/2 in the rewritten graph; `fp8_quantizations_folded`: those of them that also
    quantize their normed output to FP8 (the FP8 epilogue); `fast_all_reduces`: all-reduce-only ops of
    tier (b) (`fxfuse.passes.site_tiers`); what is left, `allreduces_after`, is tier (c).
    """

    allreduces_before: int
    merged: int
    fused_with_residual: int
    fused_without_residual: int
    allreduces_after: int
    fp8_quantizations_folded: int = 0
    fast_all_reduces: int = 0

    @property
    def fused(self) -> int:
        """All fused sites (patterns 1 and 2)."""
        return self.fused_with_residual + self.fused_without_residual


@dataclass(frozen=True)
class UnfusedSites:
    """The all-reduce sites one pass run left unfused: `count` of them, the most common `reason` (one
    site's sentence, the nodes it names being that site's) and `with_reason`, how many sites it stops
    (those whose reasons differ only in the nodes named, `fxfuse.passes.unfused_reasons.reason_kind`);
    `fast`: how many of them run the all-reduce-only op (tier (b)) rather than Inductor's (tier (c))."""

    count: int
    reason: str
    with_reason: int
    fast: int = 0


@dataclass(frozen=True)
class PassTiming:
    """How long one pass run took: all passes (`seconds`), and of that the FP8 searches that ran the
    quantizations on probe rows (`fxfuse.passes.fp8_recipe_search`): `fp8_searches` of them, while
    `fp8_search_hits` quantizations found their structure's search already done."""

    seconds: float
    fp8_search_seconds: float = 0.0
    fp8_searches: int = 0
    fp8_search_hits: int = 0


@dataclass(frozen=True)
class CompileRecord:
    """One compiled graph: the graph before and after the passes, and its stats.

    `from_cache`: Inductor loaded the graph from its FX graph or AOTAutograd cache, so the passes did
    not run in this process; the record comes from the mark the pass left with the cached graph.
    `before`/`after` are None when the snapshots kept beside the cache were not found.
    `unfused`: the sites left unfused and why, None when every all-reduce site fused (or there was none).
    `timing`: how long the passes took (None for a graph loaded from the cache).
    """

    before: GraphSnapshot | None
    after: GraphSnapshot | None
    stats: FusionStats
    from_cache: bool = False
    unfused: UnfusedSites | None = None
    timing: PassTiming | None = None

    def diff(self) -> str:
        """Readable diff of the graph before and after the passes."""
        if self.before is None or self.after is None:
            return ("no snapshots: Inductor loaded this graph from its cache and the snapshots kept beside "
                    "the cache were not found\n")
        return render_diff(self.before, self.after)


def fusion_stats(graph: torch.fx.Graph, before: GraphSnapshot, after: GraphSnapshot, merged: int) -> FusionStats:
    """Stats of one pass run from the snapshots around it and the rewritten graph."""
    fused_sites = [node for op in FUSED_OPS for node in graph.find_nodes(op="call_function", target=op)]
    without_residual = sum(1 for node in fused_sites if node.args[1] is None)
    return FusionStats(
        allreduces_before=before.op_counts[ALL_REDUCE_OP],
        merged=merged,
        fused_with_residual=len(fused_sites) - without_residual,
        fused_without_residual=without_residual,
        allreduces_after=after.op_counts[ALL_REDUCE_OP],
        fp8_quantizations_folded=sum(len(graph.find_nodes(op="call_function", target=op)) for op in FP8_OPS),
        fast_all_reduces=len(graph.find_nodes(op="call_function", target=all_reduce)),
    )


def fused_sites_on_cuda(graph: torch.fx.Graph) -> bool:
    """Whether a fused op or all-reduce-only op of the rewritten graph takes a CUDA tensor (from the nodes'
    fake values)."""
    for op in (*FUSED_OPS, all_reduce):
        for node in graph.find_nodes(op="call_function", target=op):
            value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                return True
    return False


# ---------------------------------------------------------------- marks and snapshot files


def snapshots_dir() -> Path:
    """Where the snapshots of marked graphs are kept: `fxfuse/` in Inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "fxfuse"


def mark_compiled(record: CompileRecord, on_cuda: bool) -> str:
    """Add the mark of a graph the passes just rewrote to `counters["inductor"]` (Inductor keeps it with
    the compiled graph) and keep its snapshots in their file; returns the mark's name."""
    digest = None
    if record.before is not None and record.after is not None:
        digest = _keep_snapshots(record.before, record.after)
    name = mark_name(record.stats, on_cuda, digest, record.unfused)
    counters["inductor"][name] += 1
    return name


def mark_name(stats: FusionStats, on_cuda: bool, snapshots: str | None, unfused: UnfusedSites | None = None) -> str:
    """The counter name of a pass run: `fxfuse:` + JSON of its stats, CUDA flag, snapshot digest and
    unfused sites."""
    payload = {"stats": asdict(stats), "cuda": on_cuda, "snapshots": snapshots,
               "unfused": None if unfused is None else asdict(unfused)}
    return MARK_PREFIX + json.dumps(payload, sort_keys=True, separators=(",", ":"))


def record_from_mark(name: str) -> tuple[CompileRecord, bool]:
    """(the record of a graph loaded from Inductor's cache, whether its fused ops take CUDA tensors)."""
    payload = json.loads(name.removeprefix(MARK_PREFIX))
    before = after = None
    if payload["snapshots"] is not None:
        before, after = _read_snapshots(payload["snapshots"])
    unfused = None if payload["unfused"] is None else UnfusedSites(**payload["unfused"])
    return CompileRecord(before, after, FusionStats(**payload["stats"]), from_cache=True, unfused=unfused), payload["cuda"]


def _keep_snapshots(before: GraphSnapshot, after: GraphSnapshot) -> str | None:
    """Write the snapshots to their file (named by its content's digest) unless it exists; the digest,
    or None if the file cannot be written (a hit then has no snapshots)."""
    text = json.dumps({"before": _snapshot_json(before), "after": _snapshot_json(after)}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    path = snapshots_dir() / f"{digest}.json"
    if path.exists():
        return digest
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            out.write(text)
        os.replace(out.name, path)  # atomic: ranks writing the same file never see half of it
    except OSError:
        return None
    return digest


def _read_snapshots(digest: str) -> tuple[GraphSnapshot | None, GraphSnapshot | None]:
    """The snapshots kept under `digest`, or (None, None) if their file is missing or unreadable."""
    try:
        saved = json.loads((snapshots_dir() / f"{digest}.json").read_text())
    except (OSError, ValueError):
        return None, None
    return tuple(GraphSnapshot(lines=tuple(s["lines"]), op_counts=Counter(s["op_counts"])) for s in (saved["before"], saved["after"]))


def _snapshot_json(snapshot: GraphSnapshot) -> dict:
    return {"lines": list(snapshot.lines), "op_counts": dict(snapshot.op_counts)}
