"""Put every all-reduce site of a graph in one tier, after the fusion pass has fused what it could.

- (a) the fused op, plus an FP8 quantization of its norm output folded into it (`fp8_epilogue`), where
  nothing else that Inductor would fuse into the norm's kernel reads the norm's output;
- (b) the all-reduce-only op `fxfuse::all_reduce` where the all-reduce was, with the residual add and
  the RMSNorm given back to Inductor, which fuses them with what follows as it would have: for a fused
  site whose norm output feeds such code (`epilogues.fusing_reader`: an FP8 quantization the op cannot
  fold, a cast, a scale, a clamp, a second norm), and for every summed CUDA all-reduce left unfused where
  a fused all-reduce kernel can run (`allreduce_rmsnorm_fusion.kernel_refusal`; anywhere, CPU included,
  with `fuse_without_fast_kernel`). The op runs the fastest all-reduce of the machine (NCCL where that is
  all there is, with Inductor's own calls), so a tier-(b) site costs what Inductor's code costs, or less;
- (c) Inductor's own all-reduce: other reductions, and sites no fused all-reduce kernel can run
  (float32, a world size the kernels do not take), where NCCL is all any code could use.
Without the `fast_allreduce` pattern there is no tier (b): such sites stay fused, or Inductor's.

A site moved to tier (b) gets the add and norm back as `fxfuse.op.reference.add_rmsnorm` computes them
(the arithmetic the fused op reproduces, which is the canonical form of the graph's own,
`canonical_form`). Its values are those of the unfused code, but for the spellings the canonical form
rewrites to a different rounding: `x / sqrt(v)`, `x * (1 / sqrt(v))`, `x * reciprocal(sqrt(v))` and
`x * v ** -0.5` become `x * rsqrt(v)`, which can differ in the last bit of the float32 norm (in one
review 1 of 1,048,576 bf16 outputs differed from eager), as in tier (a); every other spelling is the
same arithmetic, bit for bit. It also gets the `original_aten` of the nodes
the fusion replaced (kept by `allreduce_rmsnorm_fusion.fusible_site`), so that Inductor generates, names
and tunes the same kernels as for its own graph. Why a site is not in tier (a) is kept on
its tier-(b) node (`meta[TIER_REASON]`) for the records and `fxfuse report`. The new op is issued where
the all-reduce (or the fused op, which took the all-reduce's place) was: no collective moves.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.schema import NORM_OPS
from fxfuse.passes.allreduce_rmsnorm_fusion import kernel_refusal
from fxfuse.passes.canonical_form import ADD, CAST, MEAN, MUL, POW, RSQRT, chain_origins, emit_node, is_call, val
from fxfuse.passes.config import FAST_ALLREDUCE, FP8_EPILOGUE, PassConfig
from fxfuse.passes.epilogues import describe, fusing_reader
from fxfuse.passes.fp8_epilogue import FP8_REASON, fold, output, quantization_nodes, quantization_of
from fxfuse.passes.pattern_support import ALL_REDUCE, WAIT_TENSOR
from fxfuse.passes.unfused_reasons import explain_unfused

#: Node meta key of a tier-(b) all-reduce: why its site is not fused (tier (a)).
TIER_REASON = "fxfuse_tier_b_reason"


@dataclass(frozen=True)
class TierCounts:
    """What one run did: FP8 quantizations folded into fused sites, fused sites moved to tier (b) because of
    their epilogue, and unfused all-reduces given the all-reduce-only op."""

    fp8_folded: int = 0
    demoted: int = 0
    fast_all_reduces: int = 0


def run(graph: torch.fx.Graph, config: PassConfig) -> TierCounts:
    """Tier every site of `graph` (in place), after `allreduce_rmsnorm_fusion.run`."""
    folded = demoted = 0
    fast = config.enabled(FAST_ALLREDUCE)
    for fused in [node for op in NORM_OPS for node in graph.find_nodes(op="call_function", target=op)]:
        normed = output(fused, 0)
        if normed is None:
            continue
        match = quantization_of(fused, normed) if config.enabled(FP8_EPILOGUE) else None
        reader = fusing_reader(normed, frozenset() if match is None else quantization_nodes(normed, match))
        if match is not None and (reader is None or not fast) and fold(graph, fused, normed, match):
            folded += 1
            continue
        reader = fusing_reader(normed)  # the quantization itself, when it did not fold
        if fast and reader is not None:
            demote(graph, fused, _epilogue_reason(fused, reader))
            demoted += 1
    return TierCounts(folded, demoted, fast_all_reduces(graph, config) if fast else 0)


def _epilogue_reason(fused: torch.fx.Node, reader: torch.fx.Node) -> str:
    """Why a fused site goes to tier (b): what reads its norm's output."""
    why_unfolded = fused.meta.get(FP8_REASON)
    if why_unfolded is not None:
        return (f"its norm's output feeds a quantization the fused op cannot fold ({why_unfolded}); Inductor "
                "fuses it into the norm's kernel, so the add and norm stay with Inductor after a fast all-reduce")
    return (f"its norm's output feeds {describe(reader)}, which Inductor fuses into the norm's kernel and the fused "
            "op cannot, so the add and norm stay with Inductor after a fast all-reduce")


def demote(graph: torch.fx.Graph, fused: torch.fx.Node, reason: str) -> torch.fx.Node:
    """Replace the plain fused op `fused` by the all-reduce-only op and the residual add and RMSNorm as
    `fxfuse.op.reference.add_rmsnorm` computes them; returns the new all-reduce node."""
    x, residual, weight, eps, group_name = fused.args[:5]
    weight_offset, weight_in_fp32 = (fused.args[i] if len(fused.args) > i else fused.kwargs.get(name, default)
                                     for i, name, default in ((5, "weight_offset", 0.0), (6, "weight_in_fp32", False)))

    origins = chain_origins(x)

    def emit(target, *args):
        return emit_node(graph, target, args, before=fused, meta_from=fused, origins=origins)

    reduced = emit(all_reduce, x, group_name)
    reduced.meta[TIER_REASON] = reason
    dtype = val(x).dtype
    hidden = reduced
    if residual is not None:
        upcast = val(residual).dtype != dtype
        hidden = emit(ADD, emit(CAST, reduced, val(residual).dtype) if upcast else reduced, residual)
    in_fp32 = hidden if val(hidden).dtype == torch.float32 else emit(CAST, hidden, torch.float32)
    variance = emit(MEAN, emit(POW, in_fp32, 2), [-1], True)
    normalized = emit(MUL, in_fp32, emit(RSQRT, emit(ADD, variance, eps)))
    if weight_in_fp32:
        scale = weight if val(weight).dtype == torch.float32 else emit(CAST, weight, torch.float32)
        scale = emit(ADD, scale, weight_offset) if weight_offset else scale
        normed = _cast(emit, emit(MUL, normalized, scale), dtype)
    else:
        normed = emit(MUL, weight, _cast(emit, normalized, val(hidden).dtype))
    for index, value in ((0, normed), (1, hidden)):
        old = output(fused, index)
        if old is not None:
            old.replace_all_uses_with(value)
            graph.erase_node(old)
    for user in [u for u in fused.users if u.target is operator.getitem and not u.users]:
        graph.erase_node(user)
    graph.erase_node(fused)
    return reduced


def _cast(emit, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """`value` converted to `dtype` (itself when it already has it)."""
    return value if val(value).dtype == dtype else emit(CAST, value, dtype)


def fast_all_reduces(graph: torch.fx.Graph, config: PassConfig) -> int:
    """Give every summed CUDA all-reduce left in `graph` the all-reduce-only op where a fused all-reduce
    kernel can run (anywhere with `fuse_without_fast_kernel`); returns how many. Each keeps why it is not fused
    (`explain_unfused`) in `meta[TIER_REASON]`."""
    replaced = 0
    for collective in list(graph.find_nodes(op="call_function", target=ALL_REDUCE)):
        x, operation, group_name = collective.args[:3]
        waits = list(collective.users)
        if (operation != "sum" or len(waits) != 1 or not is_call(waits[0], WAIT_TENSOR) or val(x) is None
                or val(x).dim() < 1):  # the op reduces rows of a last dimension
            continue
        if not config.fuse_without_fast_kernel and (val(x).device.type != "cuda" or kernel_refusal(val(x), group_name)):
            continue  # no all-reduce faster than Inductor's can run it (off CUDA: gloo is all there is)
        reason = explain_unfused(collective, config)
        reduced = emit_node(graph, all_reduce, (x, group_name), before=collective, meta_from=collective)
        reduced.meta[TIER_REASON] = reason
        waits[0].replace_all_uses_with(reduced)
        graph.erase_node(waits[0])
        graph.erase_node(collective)
        replaced += 1
    return replaced
