"""`FusionRecorder`: runs fxfuse's passes on a post-grad graph and keeps what each run did.

Both compile entry points rewrite through one: `FxfuseBackend` is a recorder (`fxfuse.backend`), and
`fxfuse.post_grad_pass()` makes one for its `FusionPostGradPass` (`fxfuse.post_grad`), which also
hands it the records of graphs Inductor loaded from its caches (`add_record`). Every record is
logged (`fxfuse.rewrite.log`): a graph that keeps all-reduce sites unfused says so once, with why.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
import torch.fx
from torch._dynamo.utils import counters

from fxfuse.op.runtime.registration import install_native_fallback
from fxfuse.passes import allreduce_rmsnorm_fusion, merge_allreduce, site_tiers
from fxfuse.passes.config import PATTERNS, PassConfig
from fxfuse.passes.fp8_recipe_search import SEARCHES
from fxfuse.rewrite.graph_diff import snapshot
from fxfuse.rewrite.log import log_record, log_sites
from fxfuse.rewrite.records import CompileRecord, PassTiming, fused_sites_on_cuda, fusion_stats
from fxfuse.rewrite.sites import SiteDecision, site_decisions, sites_before, unfused_sites
from fxfuse.torch_support import warn_if_untested


class FusionRecorder:
    """Runs the enabled passes on post-grad graphs (`rewrite`) and keeps one `CompileRecord` per graph.

    patterns: names from `fxfuse.passes.config.PATTERNS` to enable (all by default).
    dump_dir: if set, each record writes `graph_<n>[_rank<r>].{before,after,diff}.txt` there.
    fuse_without_fast_kernel: also fuse CUDA sites where no fused all-reduce kernel can run (by default
    those are left unfused, see `fxfuse.op.decide.capability`; the op's fallback benchmarks turn this on).
    `records` holds the records in order; each is also summed into `counters["fxfuse"]`.
    """

    def __init__(
        self,
        patterns: Iterable[str] = PATTERNS,
        dump_dir: str | os.PathLike | None = None,
        fuse_without_fast_kernel: bool = False,
    ) -> None:
        warn_if_untested()
        if isinstance(patterns, str):
            raise ValueError(f"patterns takes pattern names (a list or set), got the string {patterns!r}: write "
                             f"patterns=[{patterns!r}]")
        self.config = PassConfig(frozenset(patterns), fuse_without_fast_kernel)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        if self.dump_dir is not None:
            _check_writable_directory(self.dump_dir)
        self.records: list[CompileRecord] = []

    def rewrite(self, graph: torch.fx.Graph) -> tuple[SiteDecision, ...]:
        """Run the enabled passes on a post-grad graph in place; record and count what they did.

        Returns what became of each all-reduce site (`fxfuse.rewrite.sites`)."""
        sites = sites_before(graph)
        before = snapshot(graph)
        started, searches = time.perf_counter(), dataclasses.replace(SEARCHES)
        merged = merge_allreduce.run(graph, self.config)
        allreduce_rmsnorm_fusion.run(graph, self.config)
        site_tiers.run(graph, self.config)
        timing = PassTiming(time.perf_counter() - started, SEARCHES.seconds - searches.seconds,
                            SEARCHES.runs - searches.runs, SEARCHES.hits - searches.hits)
        after = snapshot(graph, previous=before)
        if fused_sites_on_cuda(graph):
            install_native_fallback()  # the fused op's C++ fallback, before the graph first runs
        decisions = site_decisions(graph, sites, self.config)
        log_sites(decisions)
        stats = fusion_stats(graph, before, after, merged)
        self.add_record(CompileRecord(before, after, stats, unfused=unfused_sites(decisions), timing=timing))
        return decisions

    def add_record(self, record: CompileRecord) -> None:
        """Keep the record of a compiled graph: append it to `records`, add its stats to
        `counters["fxfuse"]`, log it (`fxfuse.rewrite.log`: a warning if sites were left unfused) and
        dump it if `dump_dir` is set."""
        self.records.append(record)
        log_record(record)
        for name, value in asdict(record.stats).items():
            counters["fxfuse"][name] += value
        if self.dump_dir is not None:
            self._dump(record, len(self.records) - 1)

    def _dump(self, record: CompileRecord, index: int) -> None:
        """Write the record's graphs and diff under `dump_dir` (one file set per rank; only the diff file,
        with the stats, for a graph loaded from Inductor's cache without its snapshots)."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        rank = f"_rank{dist.get_rank()}" if dist.is_initialized() else ""
        stem = f"graph_{index:03d}{rank}"
        if record.before is not None and record.after is not None:
            (self.dump_dir / f"{stem}.before.txt").write_text(record.before.text())
            (self.dump_dir / f"{stem}.after.txt").write_text(record.after.text())
        (self.dump_dir / f"{stem}.diff.txt").write_text(f"{record.stats}\n\n{record.diff()}")


def _check_writable_directory(path: Path) -> None:
    """ValueError unless `path` is a directory this process can write, or can be made in one (checked where it
    is given, not at the first compile)."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"dump_dir {str(path)!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"dump_dir {str(path)!r}: {str(existing)!r} is not writable by this process")
