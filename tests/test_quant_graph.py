"""The w8a8 dense linears' activation quantization is plain ops in the compiled graph, right after the norms.

The tiny preset cut to two layers (one dense, one MoE) with FP8 weights in 16 x 16 blocks (its widths at
tp=2 cover whole blocks; DeepSeek-V3's are 128) and per-token-group FP8 activations ("w8a8"), traced on
fake tensors and a fake group of 2 ranks by `torch.compile(backend=FxfuseBackend(inner="eager"),
fullgraph=True, dynamic=True)`. Checked on the post-grad graph:
- before the fusion pass: the input, post-attention and q_a norms (3 per layer) are each read by one
  `aten.amax` of the per-group quantization (float32 upcast, view [rows, K / 16, 16], abs, amax);
- after it: every all-reduce site is one fused op (1 + 2 per layer); the quantization of every site's norm
  output but the final norm's (read by the bf16 lm_head) is folded into it by the FP8-epilogue pass
  (the model flattens the normed [batch, seq, hidden] to rows before it quantizes, so the pass must
  see through that reshape), and the op's FP8 values and scales feed the two linears that read them
  (q_a_proj and kv_a_proj_with_mqa, or the MLP's gate and up) directly; the q_a norm's, o_proj's and
  down_proj's input quantizations stay plain ops;
- every FP8 projection is one `fp8_linear_quantized` (14), no `fp8_linear` is left, and the routed
  experts stay one `fxfuse_quant::quant_experts` op (they quantize their sorted rows inside it).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from fxfuse.backend import FxfuseBackend
from fxfuse.op.fp8_schema import FP8_OPS
from fxfuse.op.schema import NORM_OPS

LAYERS = 2
SITES = 1 + 2 * LAYERS
GROUP = 16
QUANTIZED_LINEAR = "fxfuse_quant.fp8_linear_quantized"
#: FP8 projections: 4 attention (q_a, q_b, kv_a, o) per layer, 3 dense-MLP in layer 0, 3 shared-expert in layer 1.
QUANTIZED_LINEARS = 4 * LAYERS + 3 + 3
#: Per-group quantizations per layer: input norm, q_a norm, attention output (o_proj), post-attention norm,
#: the MLP's (or shared experts') hidden state (down_proj).
QUANTIZATIONS = 5 * LAYERS
#: Quantizations the FP8-epilogue pass folds into the fused op: those of every site's norm output but the final norm's.
FOLDED = SITES - 1

aten, prims = torch.ops.aten, torch.ops.prims


def _upcast_source(amax: torch.fx.Node) -> torch.fx.Node | None:
    """The value a per-group quantization's `amax` reads, when it reads it as amax(abs(view(float32(views of it)))),
    with views only between that value and the float32 upcast; else None."""
    absolute = amax.args[0]
    if absolute.target != aten.abs.default or absolute.args[0].target != aten.view.default:
        return None
    grouped = absolute.args[0]
    if tuple(grouped.meta["val"].shape[1:]) != (grouped.args[0].meta["val"].shape[1] // GROUP, GROUP):
        return None
    upcast = grouped.args[0]
    if upcast.target != prims.convert_element_type.default or upcast.args[1] != torch.float32:
        return None
    source = upcast.args[0]
    while source.target == aten.view.default:
        source = source.args[0]
    return source


def _quantizations(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Source value -> the per-group quantization amax nodes reading it."""
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for amax in graph.find_nodes(op="call_function", target=aten.amax.default):
        source = _upcast_source(amax)
        if source is not None:
            found.setdefault(source, []).append(amax)
    return found


def _is_rmsnorm_output(node: torch.fx.Node) -> bool:
    """`weight * normalized` with normalized = (a cast of) x * rsqrt(...): models/layers.py RMSNorm's last op."""
    if node.target != aten.mul.Tensor:
        return False
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.target == prims.convert_element_type.default:
            arg = arg.args[0]
        if isinstance(arg, torch.fx.Node) and arg.target == aten.mul.Tensor and any(
                isinstance(a, torch.fx.Node) and a.target == aten.rsqrt.default for a in arg.args):
            return True
    return False


def _derives_by_plain_ops(node: torch.fx.Node, origin: torch.fx.Node) -> bool:
    """Whether `node` is computed from `origin` by aten / prims ops only (along at least one path)."""
    seen, pending = set(), [node]
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg is origin:
                return True
            if arg not in seen and arg.op == "call_function" and str(arg.target).startswith(("aten.", "prims.")):
                seen.add(arg)
                pending.append(arg)
    return False


class GraphKeepingBackend(FxfuseBackend):
    """An eager-inner FxfuseBackend that keeps each rewritten graph, and per graph the number of quantizations
    reading each RMSNorm output before the passes."""

    def __init__(self) -> None:
        super().__init__(inner="eager")
        self.graphs: list[torch.fx.Graph] = []
        self.norm_quantizations_before: list[list[int]] = []

    def rewrite(self, graph: torch.fx.Graph) -> None:
        self.norm_quantizations_before.append(
            [len(amaxes) for source, amaxes in _quantizations(graph).items() if _is_rmsnorm_output(source)])
        super().rewrite(graph)
        self.graphs.append(graph)


@pytest.fixture(scope="module")
def traced():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxfuse.inspect.site_report import fake_process_group
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.parallel import ParallelContext
    from fxfuse.models.presets import get_preset
    from fxfuse.models.quant.scheme import QuantScheme

    backend = GraphKeepingBackend()
    scheme = QuantScheme("fp8", fp8_block=(GROUP, GROUP), fp8_gemm="w8a8")
    with fake_process_group(2) as group, FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        model = DeepseekV3ForCausalLM(get_preset("tiny", layers=LAYERS), ParallelContext.from_group(group), dtype=torch.bfloat16,
                                      device="cpu", max_batch=2, max_seq_len=16, quant=scheme)
        torch._dynamo.reset()
        ids, positions = torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, -1)
        torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(ids, positions)
        torch._dynamo.reset()
    assert len(backend.graphs) == 1
    return backend


@pytest.mark.slow
def test_quantization_follows_each_norm_before_the_pass(traced):
    assert sorted(traced.norm_quantizations_before[0]) == [1] * 3 * LAYERS


@pytest.mark.slow
def test_every_site_fused_and_every_projection_quantized_outside_the_gemm(traced):
    record = traced.records[0]
    assert (record.stats.allreduces_before, record.stats.fused, record.stats.allreduces_after) == (SITES, SITES, 0)
    assert record.stats.fp8_quantizations_folded == FOLDED
    counts = record.after.op_counts
    assert counts[QUANTIZED_LINEAR] == QUANTIZED_LINEARS and counts["fxfuse_quant.fp8_linear"] == 0, counts
    assert counts["fxfuse_quant.quant_experts"] == 1
    # what stays plain: the q_a norm's (no all-reduce before it) and o_proj's and down_proj's inputs
    assert sum(len(amaxes) for amaxes in _quantizations(traced.graphs[0]).values()) == QUANTIZATIONS - FOLDED


@pytest.mark.slow
def test_each_folded_sites_fp8_values_and_scales_feed_its_two_linears(traced):
    graph = traced.graphs[0]
    linears = graph.find_nodes(op="call_function", target=torch.ops.fxfuse_quant.fp8_linear_quantized.default)
    folded = [site for op in FP8_OPS for site in graph.find_nodes(op="call_function", target=op)]
    assert len(folded) == FOLDED
    for site in folded:
        values, scales = (next(u for u in site.users if u.args[1] == index) for index in (0, 1))
        readers = [node for node in linears if _through_views(node.args[0]) is values]
        # q_a_proj + kv_a_proj_with_mqa, or the MLP's (shared experts') gate + up; the scales beside the values
        assert len(readers) == 2, f"{site.name} feeds {[n.name for n in readers]}"
        assert all(_through_views(node.args[1]) is scales for node in readers)
        assert values.meta["val"].dtype == torch.float8_e4m3fn and site.args[6] == GROUP  # per group of 16
    plain = [site for op in NORM_OPS for site in graph.find_nodes(op="call_function", target=op)]
    assert len(plain) == SITES - FOLDED  # the final norm's: the lm_head reads bf16


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    while node.target == aten.view.default:
        node = node.args[0]
    return node
