"""The `fxfuse` torch.compile backend: fusion passes on the post-grad graph, then Inductor or eager.

`torch.compile(model, backend="fxfuse")` resolves to `fxfuse_backend` through the
`torch_dynamo_backends` entry point, with no import of fxfuse. A configured `FxfuseBackend` object can
be passed instead: `torch.compile(model, backend=FxfuseBackend(inner="eager", patterns=...))`.

Data path: dynamo graph -> AOT autograd (functional ATen, Inductor's decompositions) -> the passes
(`merge_allreduce`, then `allreduce_rmsnorm_fusion`, then `fp8_epilogue`; for Inductor also `donate_allreduce_input`) -> the
inner compiler. With `inner="inductor"`
the passes run as Inductor's `post_grad_custom_post_pass`; with `inner="eager"` they run on the AOT
forward graph after the clean-ups Inductor does before that point, and the graph then runs as is. Every pass run is recorded on the backend object (`records`): the graph before and after, and
`FusionStats`. The same numbers are also summed into `torch._dynamo.utils.counters["fxfuse"]`, the
only view of compiles made through the `backend="fxfuse"` entry point. The rewrite depends only on
the graph, so every rank makes the same decisions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from fxfuse.inspect.graph_diff import GraphSnapshot, render_diff, snapshot
from fxfuse.op.fp8_schema import FP8_OPS
from fxfuse.op.schema import FUSED_OPS, install_native_fallback
from fxfuse.passes import allreduce_rmsnorm_fusion, donate_allreduce_input, fp8_epilogue, merge_allreduce
from fxfuse.passes.config import PATTERNS, PassConfig

INNER_COMPILERS = ("inductor", "eager")
ALL_REDUCE_OP = "_c10d_functional.all_reduce"


@dataclass(frozen=True)
class FusionStats:
    """What one pass run found and did.

    `allreduces_before`/`allreduces_after`: all-reduce nodes in the graph before/after the passes;
    `merged`: pairs merged by pattern 3; `fused_with_residual`/`fused_without_residual`: fused-op
    sites of pattern 1/2 in the rewritten graph; `fp8_quantizations_folded`: those of them that also
    quantize their normed output to FP8 (the FP8 epilogue).
    """

    allreduces_before: int
    merged: int
    fused_with_residual: int
    fused_without_residual: int
    allreduces_after: int
    fp8_quantizations_folded: int = 0

    @property
    def fused(self) -> int:
        """All fused sites (patterns 1 and 2)."""
        return self.fused_with_residual + self.fused_without_residual


@dataclass(frozen=True)
class CompileRecord:
    """One pass run: the graph before and after, and its stats."""

    before: GraphSnapshot
    after: GraphSnapshot
    stats: FusionStats

    def diff(self) -> str:
        """Readable diff of the graph before and after the passes."""
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
    )


def fused_sites_on_cuda(graph: torch.fx.Graph) -> bool:
    """Whether a fused op of the rewritten graph takes a CUDA tensor (from the nodes' fake values)."""
    for op in FUSED_OPS:
        for node in graph.find_nodes(op="call_function", target=op):
            value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                return True
    return False


class _PostGradFusionPass(CustomGraphPass):
    """The fxfuse rewrite as Inductor's `post_grad_custom_post_pass`, then the donation of each fused
    op's input (`fxfuse.passes.donate_allreduce_input`), which Inductor's re-inplacing pass completes.

    `uuid()` is None, which turns Inductor's FX graph cache off for graphs compiled with it: a cache
    hit would skip the pass, so nothing would be recorded for that compile.
    """

    def __init__(self, rewrite: Callable[[torch.fx.Graph], None]) -> None:
        self._rewrite = rewrite

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._rewrite(graph)
        donate_allreduce_input.run(graph)

    def uuid(self) -> None:
        return None


class FxfuseBackend:
    """A configured fxfuse backend: pass it as `torch.compile(..., backend=FxfuseBackend(...))`.

    inner: "inductor" (default) or "eager" (no code generation: fast, for tests).
    patterns: names from `fxfuse.passes.config.PATTERNS` to enable (all by default).
    dump_dir: if set, each pass run writes `graph_<n>[_rank<r>].{before,after,diff}.txt` there.
    fuse_without_fast_kernel: also fuse CUDA sites where no fused all-reduce kernel can run (by default
    Inductor keeps those, see `fxfuse.op.capability`; the op's fallback benchmarks turn this on).
    After compiling, `records` holds one `CompileRecord` per pass run, in order. With Inductor, the
    passes take the `post_grad_custom_post_pass` slot of Inductor's config for these compiles.
    """

    def __init__(
        self,
        inner: str = "inductor",
        patterns: Iterable[str] = PATTERNS,
        dump_dir: str | os.PathLike | None = None,
        fuse_without_fast_kernel: bool = False,
    ) -> None:
        if inner not in INNER_COMPILERS:
            raise ValueError(f"unknown inner compiler {inner!r}; choose one of {INNER_COMPILERS}")
        self.inner = inner
        self.config = PassConfig(frozenset(patterns), fuse_without_fast_kernel)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.records: list[CompileRecord] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Compile a dynamo graph: AOT autograd, the fusion passes, then the inner compiler."""
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(
                gm, example_inputs, config_patches={"post_grad_custom_post_pass": _PostGradFusionPass(self.rewrite)}
            )
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        compile_eager = aot_autograd(
            fw_compiler=self._compile_eager_graph,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        return compile_eager(gm, example_inputs)

    def _compile_eager_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """AOT graph -> the clean-ups Inductor runs before post-grad custom passes -> passes -> eager.

        The clean-ups (joint-graph passes such as pointless-view removal, then no-op removal) make
        the graph the passes see here the one they see under Inductor.
        """
        from functorch.compile import make_boxed_func
        from torch._inductor.fx_passes.joint_graph import joint_graph_passes
        from torch._inductor.fx_passes.post_grad import remove_noop_ops

        joint_graph_passes(gm)
        remove_noop_ops(gm.graph)
        self.rewrite(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    def rewrite(self, graph: torch.fx.Graph) -> None:
        """Run the enabled passes on a post-grad graph in place; record and count what they did."""
        before = snapshot(graph)
        merged = merge_allreduce.run(graph, self.config)
        allreduce_rmsnorm_fusion.run(graph, self.config)
        fp8_epilogue.run(graph, self.config)
        after = snapshot(graph, previous=before)
        record = CompileRecord(before=before, after=after, stats=fusion_stats(graph, before, after, merged))
        self.records.append(record)
        if fused_sites_on_cuda(graph):
            install_native_fallback()  # the fused op's C++ fallback, before the graph first runs
        for name, value in asdict(record.stats).items():
            counters["fxfuse"][name] += value
        if self.dump_dir is not None:
            self._dump(record, len(self.records) - 1)

    def _dump(self, record: CompileRecord, index: int) -> None:
        """Write the record's graphs and diff under `dump_dir` (one file set per rank)."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        rank = f"_rank{dist.get_rank()}" if dist.is_initialized() else ""
        stem = f"graph_{index:03d}{rank}"
        (self.dump_dir / f"{stem}.before.txt").write_text(record.before.text())
        (self.dump_dir / f"{stem}.after.txt").write_text(record.after.text())
        (self.dump_dir / f"{stem}.diff.txt").write_text(f"{record.stats}\n\n{record.diff()}")


def fusion_summary(backend: FxfuseBackend) -> dict[str, int | None]:
    """What the pass did to the graph a run last compiled: the runner's JSON fields.

    `allreduce_sites`: all-reduces in that graph before the passes; `fused_sites`: fused ops after
    them; `merged`: all-reduce pairs merged first; `graphs_compiled`: pass runs so far (one per
    compiled graph: with fullgraph=True, one per compile, e.g. a width-1 step compiled apart).
    The counts are None before anything was compiled. The last graph, not a sum over compiles: each
    compile is the whole model again, so summing would count every site once per compile.
    """
    if not backend.records:
        return {"allreduce_sites": None, "fused_sites": None, "merged": None, "graphs_compiled": 0}
    stats = backend.records[-1].stats
    return {
        "allreduce_sites": stats.allreduces_before,
        "fused_sites": stats.fused,
        "merged": stats.merged,
        "graphs_compiled": len(backend.records),
    }


def fxfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The `backend="fxfuse"` entry point: `FxfuseBackend()` with defaults (Inductor, all patterns)."""
    return FxfuseBackend()(gm, example_inputs)
