"""`fxfuse report`: which all-reduce sites of a model the fxfuse pass fuses, and why not, without weights.

`report_model(config, tp)` builds the tensor-parallel model under a `FakeTensorMode` (parameters
have shapes and dtypes but no storage), joins a fake process group of `tp` ranks in this process (no
other ranks, no communication, no GPU) and compiles one forward with `torch.compile(fullgraph=True,
dynamic=True)` through an eager-inner `FxfuseBackend`: dynamo, AOT autograd and the fxfuse passes
run as in a real compile, and the compiled graph then "runs" on fake tensors (no compute). Fake CPU
tensors rather than the meta device: torch's pattern matcher skips nodes with meta tensors.

Every all-reduce (and reduce-scatter, never fused) in a graph before the passes is one `SiteRow`:
its decoder layer and block (embedding / attention / MLP / MoE), read from the `nn_module_stack` that
the node computing the reduced value carries through AOT autograd; whether it ended up inside a fused
op (possibly after being merged with another all-reduce); and if not, why: the backend's own
`SiteDecision`s (`fxfuse.rewrite.sites`). A
compile that makes several graphs (graph breaks, one compile per block) gives rows for each, marked
with the graph's index. `fxfuse.inspect.compiled_report` reports any function or module this way.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxfuse.backend import CompileRecord, FxfuseBackend
from fxfuse.models.config import ModelConfig
from fxfuse.models.parallel import ParallelContext
from fxfuse.op.decide.settings import current_settings, what_fused_sites_run
from fxfuse.op.decide.thresholds import current_thresholds
from fxfuse.op.fp8_schema import FP8_OPS, recipe_of
from fxfuse.passes.config import PATTERNS
from fxfuse.passes.fp8_epilogue import FP8_REASON
from fxfuse.passes.unfused_reasons import (
    REDUCE_SCATTER,
    explain_unfused,
    in_another_graph,
    needs_another_graph,
    normed_inputs,
)
from fxfuse.rewrite.sites import SiteDecision

#: Block kinds by a word of the module's class name, outermost module first (DeepSeek-V3 reference
#: and Hugging Face spellings: VocabParallelEmbedding, MLAttention, MoE, ParallelGatedMLP, ...).
BLOCK_KEYWORDS = (("Embedding", "embedding"), ("Attention", "attention"), ("MoE", "MoE"), ("MLP", "MLP"))

LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class SiteRow:
    """One all-reduce (or reduce-scatter) of a graph before the passes, in graph order.

    `module`: path of the innermost module computing the reduced value (`model.layers.3.mlp`);
    `layer`: its decoder layer index (None outside the layers); `block`: embedding, attention, MLP,
    MoE, or the module's class name; `merged`: reduced together with another site first (pattern 3);
    `reason`: why it is not fused (None when fused); `graph`: which compiled graph (pass run) it is in;
    `collective`: `all_reduce` or `reduce_scatter`; `fp8`: for a fused site whose normed output is
    quantized to FP8, whether the quantization was folded into the op ("fused: <scaling>") or why not
    ("left out: <reason>"); None when no quantization follows; `tier`: "a" (fused), "b" (the
    all-reduce-only op, add and norm left to Inductor) or "c" (Inductor's all-reduce), as
    `fxfuse.passes.site_tiers` describes them (by default "a" when fused, else "c").
    """

    index: int
    layer: int | None
    block: str
    module: str
    fused: bool
    merged: bool
    reason: str | None
    graph: int = 0
    collective: str = "all_reduce"
    fp8: str | None = None
    tier: str | None = None

    def __post_init__(self) -> None:
        if self.tier is None:  # a fused site is in tier (a); an unfused one in (c) unless said otherwise
            object.__setattr__(self, "tier", "a" if self.fused else "c")


@dataclass(frozen=True)
class FusionReport:
    """What the pass made of one model's graphs: counts, one row per site, timings.

    `allreduce_sites`: all-reduces before the passes (summed over the compiled graphs); `fused_sites`:
    those that ended up inside a fused op; `fused_ops`: fused ops in the rewritten graphs (fewer than
    `fused_sites` when sites were merged); `trace_seconds`: dynamo + AOT autograd (the whole compile minus the passes);
    `pass_seconds`: the fxfuse passes with the backend's before/after snapshots and site decisions (the
    first run in a process includes tracing the patterns); `fp8_search_seconds`, `fp8_searches`,
    `fp8_quantizations`: of that, the time the FP8 searches took (`fxfuse.passes.fp8_recipe_search`), how many
    ran, and how many quantizations they decided (the others found their structure's search done);
    `runtime`: what the fused sites run under this process's FXFUSE_* settings
    (`fxfuse.op.decide.settings.what_fused_sites_run`).
    """

    model: str
    layers: int | None  # None: code with no decoder layers (`report_compiled` of a block)
    tp: int
    dtype: str
    allreduce_sites: int
    fused_sites: int
    fused_ops: int
    merged: int
    trace_seconds: float
    pass_seconds: float
    sites: tuple[SiteRow, ...]
    runtime: str = ""
    fp8_search_seconds: float = 0.0
    fp8_searches: int = 0
    fp8_quantizations: int = 0

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict (`sites` as a list of row dicts)."""
        return {**asdict(self), "sites": [asdict(row) for row in self.sites]}

    def table(self) -> str:
        """One line per site, what fused sites run (when known), then the totals."""
        lines = [f"{'#':>4}  {'layer':>5}  {'block':<10}  {'fused':<6}  {'tier':<4}  module / reason"]
        several_graphs = any(row.graph for row in self.sites)
        for row in self.sites:
            layer = "-" if row.layer is None else str(row.layer)
            fused = ("merged" if row.merged else "yes") if row.fused else "NO"
            number = f"{row.graph}:{row.index}" if several_graphs else str(row.index)
            lines.append(f"{number:>4}  {layer:>5}  {row.block:<10}  {fused:<6}  {row.tier:<4}  {row.module}"
                         + ("" if row.reason is None else f": {row.reason}")
                         + ("" if row.fp8 is None else f" [FP8 quantization {row.fp8}]"))
        if self.runtime:
            lines.append(self.runtime)
        lines.append(
            f"{self.model} ({'' if self.layers is None else f'{self.layers} layers, '}tp={self.tp}, {self.dtype}): {self.fused_sites} of "
            f"{self.allreduce_sites} all-reduce sites fused ({self.fused_ops} fused ops, {self.merged} merges), "
            f"tiers a/b/c: {'/'.join(str(sum(row.tier == t for row in self.sites)) for t in 'abc')}; "
            f"trace {self.trace_seconds:.1f} s, pass {self.pass_seconds:.2f} s"
            + (f" (FP8 searches {self.fp8_search_seconds:.2f} s: {self.fp8_searches} run for {self.fp8_quantizations} "
               "quantizations)" if self.fp8_quantizations else "")
        )
        return "\n".join(lines)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[dist.ProcessGroup]:
    """This process as rank 0 of a fake default group of `world_size` ranks (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def module_path(node: torch.fx.Node) -> tuple[str, list[str]]:
    """(dotted path of the innermost module, class names outermost first) from node.meta['nn_module_stack']."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return "", []
    path = re.sub(r"^L\['[^']+'\]\.?", "", stack[-1][0])
    path = re.sub(r"\['?([^'\]]+)'?\]", r".\1", path).replace("._modules.", ".").strip(".")
    return path, [getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1]) for _, cls in stack]


def site_location(producer: torch.fx.Node) -> tuple[int | None, str, str]:
    """(layer, block, module path) of the node that computes an all-reduced value."""
    path, classes = module_path(producer)
    block = next((kind for name in classes for word, kind in BLOCK_KEYWORDS if word in name), None)
    layer = LAYER_INDEX.search(path)
    return (int(layer.group(1)) if layer else None), block or (classes[-1] if classes else "-"), path or "-"


class SiteTracingBackend(FxfuseBackend):
    """An eager-inner `FxfuseBackend` that also records one `SiteRow` per site and times the passes.

    `sites` holds the rows of every graph compiled so far, in compile order. A site whose sum is
    returned from its graph with no RMSNorm after it, while some compiled graph applies an RMSNorm
    to an input, says so (`in_another_graph`).
    """

    def __init__(self, patterns=PATTERNS) -> None:
        super().__init__(inner="eager", patterns=patterns)
        self.sites: list[SiteRow] = []
        self.pass_seconds = 0.0
        self._rows_as_found: list[SiteRow] = []  # `sites` before `in_another_graph`
        self._normed_inputs: list[tuple[int, str]] = []  # (graph index, input name) read by an RMSNorm

    def rewrite(self, graph: torch.fx.Graph) -> tuple[SiteDecision, ...]:
        scatters = list(graph.find_nodes(op="call_function", target=REDUCE_SCATTER))
        start = time.perf_counter()
        decisions = super().rewrite(graph)
        self.pass_seconds += time.perf_counter() - start
        index = len(self.records) - 1
        rows = [_site_row(i, decision) for i, decision in enumerate(decisions)]
        rows += [self._scatter_row(node, len(rows) + i) for i, node in enumerate(scatters)]
        self._rows_as_found += [replace(row, graph=index) for row in rows]
        if any(needs_another_graph(row.reason) for row in self._rows_as_found):  # else skip the graph copy
            self._normed_inputs += [(index, name) for name in normed_inputs(graph)]
        self.sites = [_in_another_graph(row, self._normed_inputs) for row in self._rows_as_found]
        return decisions

    def _scatter_row(self, node: torch.fx.Node, index: int) -> SiteRow:
        layer, block, module = site_location(node.args[0])
        return SiteRow(index, layer, block, module, False, False, explain_unfused(node, self.config),
                       collective="reduce_scatter")


def _site_row(index: int, decision: SiteDecision) -> SiteRow:
    """The row of an all-reduce site, located by the node whose value it reduced."""
    layer, block, module = site_location(decision.producer)
    fp8 = None if decision.fused_into is None else fp8_note(decision.fused_into)
    return SiteRow(index, layer, block, module, decision.fused, decision.merged, decision.reason, fp8=fp8,
                   tier=decision.tier)


def fp8_note(site: torch.fx.Node) -> str | None:
    """What became of the FP8 quantization after a fused site (`SiteRow.fp8`)."""
    if site.target in FP8_OPS:
        return f"fused: {recipe_of(site.args, site.kwargs).describe()}"
    reason = site.meta.get(FP8_REASON)
    return None if reason is None else f"left out: {reason}"


def _in_another_graph(row: SiteRow, normed: list[tuple[int, str]]) -> SiteRow:
    """`row` with its reason made exact when its norm is in another graph (`in_another_graph`), one of
    the other graphs preferred."""
    normed = sorted(normed, key=lambda entry: entry[0] == row.graph)
    reason = in_another_graph(row.reason, normed) if row.reason is not None else None
    return row if reason == row.reason else replace(row, reason=reason)


def trace_sites(
    build: Callable[[ParallelContext], torch.nn.Module],
    make_inputs: Callable[[], tuple[torch.Tensor, ...]],
    tp: int,
    patterns=PATTERNS,
    on_build: Callable[[torch.nn.Module], object] | None = None,
) -> tuple[SiteTracingBackend, float]:
    """Compile `build(ctx)(*make_inputs())` on fake tensors and a fake group of `tp` ranks.

    Both callables run under the fake mode (no storage is allocated); `on_build(module)`, if given,
    sees the module before it is compiled (to watch progress, e.g.). Dynamo's caches are reset
    before and after (each call compiles afresh; nothing keeps the traced model alive). Returns the
    backend (sites, records, pass time) and the compile's wall time in seconds.
    """
    backend = SiteTracingBackend(patterns)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_process_group(tp) as group, fake_mode, torch.no_grad():
        module = build(ParallelContext.from_group(group))
        if on_build is not None:
            on_build(module)
        inputs = make_inputs()
        torch._dynamo.reset()
        start = time.perf_counter()
        torch.compile(module, backend=backend, fullgraph=True, dynamic=True)(*inputs)
        seconds = time.perf_counter() - start
        torch._dynamo.reset()
    return backend, seconds


def trace_model(
    config: ModelConfig,
    tp: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    tokens: int = 4,
    patterns=PATTERNS,
    on_build: Callable[[torch.nn.Module], object] | None = None,
    quant=None,
) -> tuple[SiteTracingBackend, float]:
    """`trace_sites` of one `tokens`-token step (batch 1) of the DeepSeek-V3 reference model (its weights held
    as `quant` says: a `fxfuse.models.quant.scheme.QuantScheme`, None for bf16)."""
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM

    config.check_tensor_parallel(tp)

    def build(ctx: ParallelContext) -> torch.nn.Module:
        return DeepseekV3ForCausalLM(config, ctx, dtype=dtype, device="cpu", max_batch=1, max_seq_len=tokens, quant=quant)

    def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens).unsqueeze(0)

    return trace_sites(build, make_inputs, tp, patterns, on_build)


def report_model(
    config: ModelConfig, tp: int, *, name: str, dtype: torch.dtype = torch.bfloat16, patterns=PATTERNS,
    on_build: Callable[[torch.nn.Module], object] | None = None, quant=None,
) -> FusionReport:
    """Trace the DeepSeek-V3 reference model (`trace_model`) and report every all-reduce site."""
    backend, seconds = trace_model(config, tp, dtype=dtype, patterns=patterns, on_build=on_build, quant=quant)
    return summarize(backend, seconds, model=name, layers=config.num_hidden_layers, tp=tp, dtype=dtype)


def summarize(backend: SiteTracingBackend, compile_seconds: float, *, model: str, layers: int | None, tp: int,
              dtype: torch.dtype) -> FusionReport:
    """The `FusionReport` of a `trace_sites` run (summed over its graphs when it compiled several)."""
    records: list[CompileRecord] = backend.records
    return FusionReport(
        model=model,
        layers=layers,
        tp=tp,
        dtype=str(dtype).removeprefix("torch."),
        allreduce_sites=sum(record.stats.allreduces_before for record in records),
        fused_sites=sum(row.fused for row in backend.sites),
        fused_ops=sum(record.stats.fused for record in records),
        merged=sum(record.stats.merged for record in records),
        trace_seconds=round(compile_seconds - backend.pass_seconds, 3),
        pass_seconds=round(backend.pass_seconds, 3),
        sites=tuple(backend.sites),
        runtime=what_fused_sites_run(current_settings(), current_thresholds()),
        fp8_search_seconds=round(sum(r.timing.fp8_search_seconds for r in records if r.timing), 3),
        fp8_searches=sum(r.timing.fp8_searches for r in records if r.timing),
        fp8_quantizations=sum(r.timing.fp8_searches + r.timing.fp8_search_hits for r in records if r.timing),
    )
