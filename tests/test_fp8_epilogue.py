"""The FP8 epilogue (issues 22 and 29): an FP8 quantization of a fused site's norm output folds into the
fused op's FP8 variant, for the spellings plain PyTorch code writes (this project's per-token-group
quantization; DeepSeek-V3's act_quant arithmetic, with UE8M0 scales too; vLLM's QuantFP8 native
per-token and per-group forwards, with UE8M0 scales; SGLang's torch per-token-group quantization;
torchao's dynamic per-row and e8m0 scales; a reciprocal multiply; a static per-tensor scale); exact
graph counts, exact reasons when it is left out (the defects of issue 29 among them: each used to fold
wrongly or crash), and numerics equal to eager on two gloo ranks (CPU: bit for bit, codes and
scales). The quantization spellings here are user code, written independently of the pass, each
naming its source."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from nccl_plan_helpers import use_nccl_plans
from toy_graphs import GraphCapture, compile_and_run, fake_process_group, rmsnorm_transformers

from fxfuse.backend import FxfuseBackend
from fxfuse.op.fp8_recipe import GRAPH_BOUND_MARK, Fp8Limits, Fp8Recipe, cast_saturates, quantize_fp8, rounded_to, scale_shape
from fxfuse.op.fp8_schema import FP8_OPS, allreduce_residual_rmsnorm_fp8, recipe_of
from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.passes.config import FAST_ALLREDUCE, FP8_EPILOGUE, PATTERNS
from fxfuse.passes.fp8_epilogue import FP8_REASON
from fxfuse.passes.site_tiers import TIER_REASON
from fxfuse.runner.launch import run_on_ranks

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # a module constant, as models/quant has it: dynamic=True makes it a graph input
HIDDEN = 256

# ---------------------------------------------------------------- quantizations as users write them


def per_group_models_quant(x):
    """This project's models/quant `quantize_activations` (group 128), on the normed [T, H] output."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, (-cols) % 128)).view(rows, -1, 128)
    amax = padded.abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / FP8_MAX
    quantized = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(rows, -1)[:, :cols], scale


def per_group_deepseek(x):
    """DeepSeek-V3 inference's act_quant arithmetic in torch: rows of 128, keepdim, no clamp."""
    grouped = x.float().view(-1, 128)
    scale = grouped.abs().amax(-1, keepdim=True) / 448.0
    return (grouped / scale).to(FP8).view(x.shape), scale.view(*x.shape[:-1], -1)


def per_row_torchao_spelling(x):
    """torchao's dynamic PerRow arithmetic (scale in the activation dtype, then float32)."""
    scale = (x.abs().amax(-1, keepdim=True) / 448.0).to(torch.float32)
    return (x.float() / scale).clamp(min=-448.0, max=448.0).to(FP8), scale


def per_group_deepseek_ue8m0(x):
    """DeepSeek-V3 inference's act_quant with scale_fmt="ue8m0" (DeepSeek-V3.1 and later checkpoints),
    its kernel's arithmetic in torch: the group maximum bounded below by 1e-4, / 448, the scale rounded
    up to a power of two (ceil of log2)."""
    grouped = x.float().view(-1, 128)
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (grouped / scale).to(FP8).view(x.shape), scale.view(*x.shape[:-1], -1)


def per_token_vllm(x):
    """vLLM's QuantFP8.forward_native, dynamic per token: the maximum of the 16-bit values, then float32,
    the scale bounded below by 1 / (448 * 512), the values times the scale's reciprocal."""
    x_max, _ = x.abs().max(dim=-1)
    x_max = x_max.unsqueeze(-1).to(torch.float32)
    scale = (x_max / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    out = x.to(torch.float32) * scale.reciprocal()
    return out.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _per_group_vllm(x, ue8m0: str | None):
    """vLLM's QuantFP8 per-group native forward: pad to the group, a 16-bit view of groups divided by
    float32 scales (type promotion), `.max(dim=-1, keepdim=True)[0]`, optional UE8M0 scales: rounded up to
    a power of two after the lower bound (`ue8m0="bound_then_round"`) or, as its newer releases write it,
    before it (`"round_then_bound"`; issue 39: the recipe could only bound, then round)."""
    hidden = x.shape[-1]
    groups = (hidden + 127) // 128
    padded = groups * 128
    if padded != hidden:
        x = F.pad(x, (0, padded - hidden), mode="constant", value=0.0)
    grouped = x.view(-1, groups, 128)
    absmax = grouped.abs().max(dim=-1, keepdim=True)[0].float()
    scales = absmax / FP8_MAX
    if ue8m0 == "round_then_bound":
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    scales = scales.clamp(min=1.0 / (FP8_MAX * 512.0))
    if ue8m0 == "bound_then_round":
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    quantized = (grouped / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(-1, padded)
    if padded != hidden:
        quantized = quantized[..., :hidden]
    return quantized, scales.squeeze(-1)


def per_group_vllm(x):
    return _per_group_vllm(x, None)


def per_group_vllm_ue8m0_rounded_then_bounded(x):
    return _per_group_vllm(x, "round_then_bound")


def per_row_power_of_two_scalar_base(x):
    """A power-of-two scale written `torch.pow(2.0, ...)` (a scalar base; issue 39)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def per_row_one_sided_clamp(x):
    """A clamp from above only: the cast of torch 2.13 on saturates below -448 as the clamp would."""
    scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    return (x.float() / scale).clamp(max=448.0).to(FP8), scale


def per_group_vllm_ue8m0(x):
    return _per_group_vllm(x, "bound_then_round")


def per_group_sglang(x):
    """SGLang's torch per-token-group FP8 quantization (its tests' native reference): rows of 128 of the
    flattened input, `.max(...)[0].clamp(min=eps)` in the activation dtype, then float32."""
    flat = x.reshape(x.numel() // 128, 128)
    amax = flat.abs().max(dim=-1, keepdim=True)[0].clamp(min=1e-10).to(torch.float32)
    scale = amax / FP8_MAX
    quantized = (flat / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return quantized.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // 128)


def per_group_reciprocal_unflatten(x):
    """Groups by `unflatten`, `torch.finfo(...).max`, and a multiply by `1.0 / scale` (Python's spelling of a
    reciprocal): the rounding of a reciprocal multiply, not of a division."""
    grouped = x.float().unflatten(-1, (-1, 128))
    scale = grouped.abs().amax(-1, keepdim=True) / torch.finfo(FP8).max
    return (grouped * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8).flatten(-2), scale


def per_row_torchao_e8m0(x):
    """torchao's `_choose_scale_float8` with float8_e8m0fnu scales (`exp2(round(log2(s)))`), on float32
    activations; values divided, clamped (`_quantize_affine_float8`)."""
    scale = torch.exp2(torch.round(torch.log2(x.float().abs().amax(-1, keepdim=True) / 448.0)))
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def per_group_sliced(x):
    """Issue 29 defect 1: the caller keeps a slice of the quantized values (`q[:, :128]`); it was taken for
    the padding's slice back (wrong shape and values, or a failed compile)."""
    quantized, scale = per_group_models_quant(x)
    return quantized[:, :128], scale


def per_row_divisor_made_after_the_all_reduce(x):
    """Issue 29 defect 3: a divisor tensor created in the code after the collective (a constant the graph
    defines after the site) was read by the op before its definition."""
    scale = x.float().abs().amax(-1, keepdim=True) / torch.tensor(448.0)
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def static_multiply(x, inverse_scale):
    return (x.float() * inverse_scale).clamp(-448.0, 448.0).to(FP8), inverse_scale


def static_divide(x, scale):
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def block(x, residual, weight, group, quantize, *scale):
    hidden = funcol.all_reduce(x, "sum", group) + residual
    quantized, scales = quantize(rmsnorm_transformers(hidden, weight, 1e-6), *scale)
    return quantized, scales, hidden


VLLM_MIN_SCALE = rounded_to(1.0 / (448.0 * 512.0), torch.float32)
#: A code without a clamp before the cast: on a torch whose cast saturates (2.13 on) it is the clamped recipe, the
#: first in the search's order of preference (the two give the same values there).
UNCLAMPED = cast_saturates()
SPELLINGS = {
    "per_group_models_quant": (per_group_models_quant, Fp8Recipe("per_group", 128, rounded_to(1e-12, torch.float32))),
    "per_group_deepseek": (per_group_deepseek, Fp8Recipe("per_group", 128, saturate=UNCLAMPED)),
    "per_group_deepseek_ue8m0": (per_group_deepseek_ue8m0, Fp8Recipe(
        "per_group", 128, rounded_to(1e-4, torch.float32), power_of_two="ceil", saturate=UNCLAMPED)),
    "per_token_vllm": (per_token_vllm, Fp8Recipe("per_row", min_scale=VLLM_MIN_SCALE, reciprocal=True)),
    "per_group_vllm": (per_group_vllm, Fp8Recipe("per_group", 128, min_scale=VLLM_MIN_SCALE)),
    "per_group_vllm_ue8m0": (per_group_vllm_ue8m0, Fp8Recipe("per_group", 128, min_scale=VLLM_MIN_SCALE,
                                                             power_of_two="ceil")),
    "per_group_vllm_ue8m0_rounded_then_bounded": (per_group_vllm_ue8m0_rounded_then_bounded, Fp8Recipe(
        "per_group", 128, min_scale=VLLM_MIN_SCALE, power_of_two="ceil", bound_after_power_of_two=True)),
    "per_row_power_of_two_scalar_base": (per_row_power_of_two_scalar_base, Fp8Recipe("per_row", power_of_two="ceil")),
    "per_row_one_sided_clamp": (per_row_one_sided_clamp, Fp8Recipe("per_row")),
    "per_group_sglang": (per_group_sglang, Fp8Recipe("per_group", 128, rounded_to(1e-10, torch.bfloat16))),
    "per_group_reciprocal_unflatten": (per_group_reciprocal_unflatten, Fp8Recipe("per_group", 128, reciprocal=True)),
    "per_row_torchao_spelling": (per_row_torchao_spelling, Fp8Recipe("per_row", 0, 0.0, torch.bfloat16)),
    "per_row_torchao_e8m0": (per_row_torchao_e8m0, Fp8Recipe("per_row", power_of_two="nearest")),
    "per_group_sliced": (per_group_sliced, Fp8Recipe("per_group", 128, rounded_to(1e-12, torch.float32))),
    "per_row_divisor_made_after_the_all_reduce": (per_row_divisor_made_after_the_all_reduce, Fp8Recipe("per_row")),
    "static_multiply": (static_multiply, Fp8Recipe("static_mul")),
    "static_divide": (static_divide, Fp8Recipe("static_div")),
}
#: Spellings left unfolded under dynamic=True (the toy's row width is symbolic there, unlike a model's, whose
#: width comes from its weights), and why: grouping the flattened rows (`view(-1, 128)`) lets a group span two
#: rows of a width not known to be a multiple of 128 (test_a_flattened_grouping_of_a_symbolic_width_is_left_out).
DYNAMIC_UNFOLDED = {"per_group_deepseek": "groups the flattened rows", "per_group_deepseek_ue8m0": "groups the flattened rows",
                    "per_group_sglang": "groups the flattened rows"}


def _inputs(seed: int, dtype=torch.bfloat16, tokens: int = 4):
    g = torch.Generator().manual_seed(seed)
    common = torch.Generator().manual_seed(99)
    return (torch.randn(tokens, HIDDEN, generator=g).to(dtype), torch.randn(tokens, HIDDEN, generator=common).to(dtype),
            (1 + 0.1 * torch.randn(HIDDEN, generator=common)).to(dtype))


def _scale_args(name: str) -> tuple:
    return (torch.tensor(0.37),) if name.startswith("static") else ()


def _fused_node(graph):
    nodes = [n for op in FP8_OPS for n in graph.find_nodes(op="call_function", target=op)]
    return nodes[0] if nodes else None


def _compile_on_fake_group(fn, *args, patterns=PATTERNS):
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda *a: fn(*a, group.group_name), *args, backend=GraphCapture(patterns=patterns))
        (graph,) = capture.graphs
        return capture.records[-1].stats, graph.graph


@pytest.mark.parametrize("name", SPELLINGS)
def test_each_spelling_folds_into_one_fp8_op(name):
    quantize, recipe = SPELLINGS[name]
    stats, graph = _compile_on_fake_group(lambda x, r, w, *s: block(x, r, w, s[-1], quantize, *s[:-1]), *_inputs(0),
                                          *_scale_args(name))
    assert (stats.fused, stats.fp8_quantizations_folded, stats.allreduces_after) == (1, 1, 0)
    node = _fused_node(graph)
    assert recipe_of(node.args, node.kwargs) == recipe and node.args[10] is False  # the bf16 normed output is not needed
    targets = {str(n.target) for n in graph.nodes}
    assert not targets & {"aten.amax.default", "aten.abs.default", "aten.clamp_min.default", "aten.clamp_max.default",
                          "aten.max.dim", "aten.log2.default", "aten.exp2.default", "aten.reciprocal.default"}
    assert not any(n.target is torch.ops.prims.convert_element_type.default for n in graph.nodes)


def test_the_normed_output_is_returned_when_something_else_reads_it():
    def also_reads_normed(x, r, w, group):
        hidden = funcol.all_reduce(x, "sum", group) + r
        normed = rmsnorm_transformers(hidden, w, 1e-6)
        quantized, scales = per_group_models_quant(normed)
        return quantized, scales, normed @ torch.ones(HIDDEN, 2, dtype=normed.dtype), hidden

    stats, graph = _compile_on_fake_group(also_reads_normed, *_inputs(0))
    assert stats.fp8_quantizations_folded == 1 and _fused_node(graph).args[10] is True


def test_a_linears_flattened_input_folds():
    """A linear flattens the normed [batch, seq, hidden] to rows before it quantizes (models/layers.py w8a8);
    the flattened value may also be read by another op (the routed experts read it in bf16)."""
    from fxfuse.models.quant.act_quant import quantize_linear_input

    def flattening(x, r, w, group):
        hidden = funcol.all_reduce(x, "sum", group) + r
        rows = rmsnorm_transformers(hidden, w, 1e-6).reshape(-1, HIDDEN)
        quantized, scales = quantize_linear_input(rows, 128)
        return quantized, scales, rows @ torch.ones(HIDDEN, 2, dtype=rows.dtype), hidden

    inputs = [t.view(2, 2, HIDDEN) for t in _inputs(0)[:2]] + [_inputs(0)[2]]
    stats, graph = _compile_on_fake_group(flattening, *inputs)
    assert stats.fp8_quantizations_folded == 1 and _fused_node(graph).args[10] is True
    assert recipe_of(_fused_node(graph).args, {}) == Fp8Recipe("per_group", 128, rounded_to(1e-12, torch.float32))


def _e5m2(x):
    grouped = x.float().view(-1, 128)
    scale = grouped.abs().amax(-1, keepdim=True) / 57344.0
    return (grouped / scale).to(torch.float8_e5m2).view(x.shape), scale


def _other_bound(x):
    scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    return (x.float() / scale).clamp(-240.0, 240.0).to(FP8), scale


def _other_maximum(x):
    scale = x.float().abs().amax(-1, keepdim=True) / 240.0
    return (x.float() / scale).to(FP8), scale


def _columns(x):
    scale = x.float().abs().amax(0, keepdim=True) / 448.0
    return (x.float() / scale).to(FP8), scale


def _shared_maximum(x):
    amax = x.float().abs().amax(-1, keepdim=True)
    return (x.float() / (amax / 448.0)).to(FP8), amax  # the maximum itself leaves the quantization


def _scale_from_the_norm(x):
    scale = x.float().abs().amax() / 448.0  # one value, but computed from the normed output: not static
    return (x.float() * (1.0 / scale)).to(FP8), scale


def _per_tensor_dynamic(x):
    """Issue 29 defect 2: `amax()` with no dimension (one dynamic scale per tensor) crashed the matcher."""
    scale = x.float().abs().amax() / 448.0
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def _clamp_from_448(x):
    """Issue 29 defect 4: `clamp(min=448)` saturates everything to 448 in eager; it was taken for +-448."""
    scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    return (x.float() / scale).clamp(min=448.0).to(FP8), scale


def _scale_on_the_wrong_axis(x):
    """Issue 29 defect 5: a [T] scale unsqueezed at 0 broadcasts across columns (T == hidden here)."""
    scale = x.float().abs().amax(-1) / 448.0
    return (x.float() / scale.unsqueeze(0)).clamp(-448.0, 448.0).to(FP8), scale


def _divisor_from_the_norm(x):
    """Issue 29 defect 3: a divisor computed from the norm's output (a cycle once the op reads it)."""
    divisor = x.float().sum() * 0.0 + 448.0
    scale = x.float().abs().amax(-1, keepdim=True) / divisor
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def _power_of_two_before_the_bound(x):
    scale = torch.exp2(torch.ceil(torch.log2(x.float().abs().amax(-1, keepdim=True)))).clamp(min=1e-4) / 448.0
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


#: What no recipe computes: the codes differ (an e4m3 value) or the scales (a scale) on some probe row.
NO_RECIPE = "no recipe of the fused op computes this quantization"
LEFT_OUT = {
    "e5m2": (_e5m2, "casts to torch.float8_e5m2, not float8_e4m3fn"),
    "other_bound": (_other_bound, f"{NO_RECIPE}: the closest, `per_row`, first differs on the probe row"),
    "clamp_from_448": (_clamp_from_448, "e4m3 value"),
    "per_tensor_dynamic": (_per_tensor_dynamic, "dynamic per-tensor scaling) is not folded"),
    "scale_on_the_wrong_axis": (_scale_on_the_wrong_axis, "they would be read across the columns"),
    "divisor_from_the_norm": (_divisor_from_the_norm, "is computed from the norm's output"),
    "power_of_two_before_the_bound": (_power_of_two_before_the_bound, f"{NO_RECIPE}: the closest"),
    "other_maximum": (_other_maximum, "where `div` (the float32 value read besides the e4m3 values) has"),
    "columns": (_columns, "reduces over dimensions [0], not the last one"),
    "shared_maximum": (_shared_maximum, "where `amax` (the float32 value read besides the e4m3 values) has"),
    "scale_from_the_norm": (_scale_from_the_norm, "dynamic per-tensor scaling) is not folded"),
}


#: Cases whose spelling needs as many tokens as the hidden size (eager would not broadcast otherwise).
TOKENS_AS_HIDDEN = {"scale_on_the_wrong_axis"}


@pytest.mark.parametrize("name", LEFT_OUT)
def test_a_quantization_left_out_moves_the_site_to_tier_b_and_says_why(name):
    """The unfolded quantization is code Inductor fuses into the norm: the site gets the all-reduce-only op and
    Inductor the add, norm and quantization (issue 31); without that tier it stays fused, the reason on it."""
    quantize, reason = LEFT_OUT[name]
    inputs = _inputs(0, tokens=HIDDEN if name in TOKENS_AS_HIDDEN else 4)
    stats, graph = _compile_on_fake_group(lambda x, r, w, group: block(x, r, w, group, quantize), *inputs)
    assert (stats.fused, stats.fp8_quantizations_folded, stats.fast_all_reduces) == (0, 0, 1)
    (fast,) = graph.find_nodes(op="call_function", target=all_reduce)
    assert "Inductor fuses" in fast.meta[TIER_REASON], fast.meta[TIER_REASON]
    if name != "divisor_from_the_norm":  # its divisor reads the norm too: that reader is named instead
        assert reason in fast.meta[TIER_REASON], fast.meta[TIER_REASON]
    stats, graph = _compile_on_fake_group(lambda x, r, w, group: block(x, r, w, group, quantize), *inputs,
                                          patterns=[p for p in PATTERNS if p != FAST_ALLREDUCE])
    assert (stats.fused, stats.fp8_quantizations_folded, stats.fast_all_reduces) == (1, 0, 0)
    (fused,) = [n for n in graph.nodes if str(n.target) == "fxfuse.allreduce_residual_rmsnorm.default"]
    assert reason in fused.meta[FP8_REASON], fused.meta[FP8_REASON]


def test_the_pattern_can_be_disabled():
    """Without the FP8 epilogue the quantization is one more epilogue: tier (b), or fused without tier (b)."""
    without_fp8 = [p for p in PATTERNS if p != FP8_EPILOGUE]
    stats, _ = _compile_on_fake_group(lambda x, r, w, g: block(x, r, w, g, per_group_deepseek), *_inputs(0),
                                      patterns=without_fp8)
    assert (stats.fused, stats.fp8_quantizations_folded, stats.fast_all_reduces) == (0, 0, 1)
    stats, _ = _compile_on_fake_group(lambda x, r, w, g: block(x, r, w, g, per_group_deepseek), *_inputs(0),
                                      patterns=[p for p in without_fp8 if p != FAST_ALLREDUCE])
    assert (stats.fused, stats.fp8_quantizations_folded, stats.fast_all_reduces) == (1, 0, 0)


# ---------------------------------------------------------------- numerics on two gloo ranks


def _compiled_vs_eager_on_rank(ctx, inner: str, dynamic: bool = False):
    out = {}
    for name, (quantize, _) in SPELLINGS.items():
        inputs = (*_inputs(ctx.rank), *_scale_args(name))

        def fn(x, r, w, *s):
            return block(x, r, w, ctx.group.group_name, quantize, *s)

        backend, got = compile_and_run(fn, *inputs, backend=FxfuseBackend(inner=inner), dynamic=dynamic)
        with torch.no_grad():
            expected = fn(*inputs)
        out[name] = (_bits(got), _bits(expected), backend.records[-1].stats.fp8_quantizations_folded)
    return out


def _bits(tensors) -> list:
    """(dtype, the bytes as uint8 (FP8) or the tensor) of each output: FP8 tensors do not pickle back from a rank."""
    return [(t.dtype, t.view(torch.uint8) if t.dtype == FP8 else t) for t in tensors]


def _assert_bit_identical(got, expected, name):
    for (got_dtype, g), (expected_dtype, e) in zip(got, expected):
        assert got_dtype == expected_dtype and g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_compiled_fp8_sites_equal_eager_bit_for_bit_eager_inner():
    """Quick loop: the CPU kernel's arithmetic is the unfused code's (codes, scales, residual)."""
    for out in run_on_ranks(_compiled_vs_eager_on_rank, 2, "eager", timeout_s=300):
        for name, (got, expected, folded) in out.items():
            assert folded == 1, name
            _assert_bit_identical(got, expected, name)


@pytest.mark.slow
def test_under_dynamic_shapes_too():
    """`dynamic=True` makes the row width symbolic and the module constant 448 a graph input (the op then
    reads it when it runs): every spelling still folds, bit for bit."""
    for out in run_on_ranks(_compiled_vs_eager_on_rank, 2, "eager", True, timeout_s=600):
        for name, (got, expected, folded) in out.items():
            # DeepSeek's view(-1, 128) groups the flattened rows: with a symbolic width, a group could span two
            # rows, so that quantization stays unfolded (test_a_flattened_grouping_of_a_symbolic_width_is_left_out)
            assert folded == (name not in DYNAMIC_UNFOLDED), name
            _assert_bit_identical(got, expected, name)


@pytest.mark.parametrize("name", DYNAMIC_UNFOLDED)
def test_a_flattened_grouping_of_a_symbolic_width_is_left_out(name):
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, SPELLINGS[name][0]), *_inputs(0),
                                     backend=GraphCapture(patterns=PATTERNS), dynamic=True)
        (graph,) = capture.graphs
    (fast,) = graph.graph.find_nodes(op="call_function", target=all_reduce)  # tier (b): Inductor quantizes
    assert DYNAMIC_UNFOLDED[name] in fast.meta[TIER_REASON], fast.meta[TIER_REASON]


@pytest.mark.slow
def test_compiled_fp8_sites_equal_eager_bit_for_bit_inductor_inner():
    for out in run_on_ranks(_compiled_vs_eager_on_rank, 2, "inductor", timeout_s=900):
        for name, (got, expected, folded) in out.items():
            assert folded == 1, name
            _assert_bit_identical(got, expected, name)


def test_torchao_itself_folds_and_matches():
    """torchao's own `_choose_scale_float8` + `_quantize_affine_float8` (dynamic PerRow), where it installs."""
    quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")

    def torchao_row(x):
        scale = quant_primitives._choose_scale_float8(x, [1, x.shape[-1]])
        return quant_primitives._quantize_affine_float8(x, scale), scale

    stats, graph = _compile_on_fake_group(lambda x, r, w, g: block(x, r, w, g, torchao_row), *_inputs(0))
    assert stats.fp8_quantizations_folded == 1
    assert recipe_of(_fused_node(graph).args, {}) == Fp8Recipe("per_row", 0, 0.0, torch.bfloat16)
    normed, _ = add_rmsnorm(*_inputs(0)[:1], None, _inputs(0)[2], 1e-6)
    q, s = quantize_fp8(normed, Fp8Recipe("per_row", 0, 0.0, torch.bfloat16))
    q_ao, s_ao = torchao_row(normed)
    torch.testing.assert_close((q.float(), s), (q_ao.float(), s_ao), rtol=0, atol=0)  # the recipe is torchao's arithmetic


# ---------------------------------------------------------------- the op itself


@pytest.mark.parametrize("name", SPELLINGS)
def test_opcheck(name):
    _, recipe = SPELLINGS[name]
    with fake_process_group() as group:
        x, residual, weight = _inputs(0)
        scale = _scale_args(name)[0] if name.startswith("static") else None
        args = (x, residual, weight, 1e-6, group.group_name, recipe.scaling, recipe.group_size, recipe.min_amax,
                recipe.scale_dtype, scale, True)
        torch.library.opcheck(allreduce_residual_rmsnorm_fp8, args)
        quantized, scales, residual_out, normed = allreduce_residual_rmsnorm_fp8(*args)
        assert list(scales.shape) == scale_shape(x.shape, recipe) and normed.shape == x.shape


def _matches_apart_from_interpreter_misrounding(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """e4m3 codes equal, except where Triton's CPU interpreter misrounds: a value whose rounding carries
    into the exponent (it returns half the power of two torch and the GPU return), a subnormal (it
    rounds toward zero, one subnormal step of 2**-9 below), a tie (it rounds half away from zero: one
    code up in magnitude; power-of-two scales make exact ties common) or NaN (it writes 0x7c). Codes
    are compared exactly on the GPU."""
    got_codes = got.to(FP8).view(torch.uint8).int()
    expected_codes = expected.to(FP8).view(torch.uint8).int()
    got, expected = got.float(), expected.float()
    differ = got != expected
    carries = (got * 2 == expected) & (torch.log2(expected.abs()) % 1 == 0)
    subnormal = (expected.abs() <= 2**-6) & ((got - expected).abs() <= 2**-9)
    tie_away = got_codes == expected_codes + 1
    nan = expected.isnan() & ((got_codes & 0x7F) == 0x7C)
    return bool((~differ | carries | subnormal | tie_away | nan).all())


def _nccl_plan_fp8_on_rank(ctx):
    """The CUDA dispatch's NCCL plan of the FP8 variant on CPU tensors (Triton's interpreter), fp16 (a scale
    computed in the activation dtype in fp16 too: the interpreter rounds to bfloat16 wrongly)."""
    import dataclasses

    from fxfuse.op.runtime import cuda_dispatch

    name = use_nccl_plans(ctx)
    out = []
    cases = [(spelling, recipe, Fp8Limits()) for spelling, (_, recipe) in SPELLINGS.items()]
    cases.append(("values_from_the_graph", Fp8Recipe("per_group", 128, GRAPH_BOUND_MARK, min_scale=GRAPH_BOUND_MARK,
                                                     bounds_from_graph="min_amax,min_scale"), Fp8Limits(240.0, 100.0, 0.5, 2e-3)))
    for spelling, recipe, limits in cases:
        if recipe.scale_dtype == torch.bfloat16:
            recipe = dataclasses.replace(recipe, scale_dtype=torch.float16)
        x, residual, weight = _inputs(ctx.rank, torch.float16, tokens=3)
        scale = torch.tensor(0.37) if spelling.startswith("static") else None
        for return_normed in (False, True):
            q, *rest = cuda_dispatch.allreduce_residual_rmsnorm_fp8_cuda(x.clone(), residual, weight, 1e-6, name, recipe,
                                                                         scale, return_normed, x_donated=True, limits=limits)
            assert q.dtype == FP8
            out.append((spelling, recipe, scale, return_normed, x, residual, weight, (q.float(), *rest), limits))
    return out


def test_the_nccl_plan_runs_the_fused_fp8_kernel():
    rank0, rank1 = run_on_ranks(_nccl_plan_fp8_on_rank, 2, timeout_s=300)
    for case0, case1 in zip(rank0, rank1):
        spelling, recipe, scale, return_normed, x0, residual, weight, (q, scales, residual_out, normed), limits = case0
        expected_normed, expected_residual = add_rmsnorm(x0 + case1[4], residual, weight, 1e-6)
        expected_q, expected_scales = quantize_fp8(expected_normed, recipe, scale, limits)
        torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
        torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0, msg=lambda m: f"{spelling}: {m}")
        assert _matches_apart_from_interpreter_misrounding(q, expected_q), spelling
        assert normed.shape == ((3, HIDDEN) if return_normed else (0,))
        if return_normed:
            torch.testing.assert_close(normed, expected_normed, rtol=0, atol=0)


def test_report_compiled_says_whether_each_sites_quantization_was_fused():
    """`report_compiled` (and `fxfuse report`) name the fused quantization, or why it was left out."""
    from fxfuse.inspect.compiled_report import report_compiled

    def two_sites(x, r, w, group):
        quantized, scales, hidden = block(x, r, w, group, per_group_deepseek)
        return block(quantized.float().to(x.dtype), hidden, w, group, _other_bound)

    with fake_process_group() as group:
        report = report_compiled(two_sites, *_inputs(0), group.group_name)
    described = Fp8Recipe("per_group", 128, saturate=UNCLAMPED).describe()
    assert [row.fp8 for row in report.sites] == [f"fused: {described}", None]
    assert [row.tier for row in report.sites] == ["a", "b"]
    assert f"{NO_RECIPE}: the closest, `per_row`, first differs on the probe row" in report.sites[1].reason
    assert f"[FP8 quantization fused: {described}]" in report.table()


class _NormThenQuantize(torch.nn.Module):
    """A model's block: the norm weight is a parameter, so its width is static even under dynamic=True."""

    def __init__(self, quantize, group_name: str):
        super().__init__()
        self.weight = torch.nn.Parameter(_inputs(0)[2], requires_grad=False)
        self.quantize, self.group_name = quantize, group_name

    def forward(self, x, residual):
        hidden = funcol.all_reduce(x, "sum", self.group_name) + residual
        quantized, scales = self.quantize(rmsnorm_transformers(hidden, self.weight, 1e-6))
        return quantized, scales, hidden


@pytest.mark.parametrize("name", [n for n in DYNAMIC_UNFOLDED if "flattened" in DYNAMIC_UNFOLDED[n]])
def test_a_flattened_grouping_folds_under_dynamic_shapes_when_the_width_comes_from_a_weight(name):
    """What DYNAMIC_UNFOLDED leaves out in toy functions folds in a model: the weight's width specializes
    the hidden size, so the flattened groups are known to lie within rows."""
    with fake_process_group() as group:
        module = _NormThenQuantize(SPELLINGS[name][0], group.group_name)
        capture, _ = compile_and_run(module, *_inputs(0)[:2], backend=GraphCapture(patterns=PATTERNS), dynamic=True)
    assert capture.records[-1].stats.fp8_quantizations_folded == 1
    assert any(not isinstance(size, int) for size in _fused_node(capture.graphs[0].graph).meta["val"][0].shape)  # tokens symbolic


def test_torchao_e8m0_scales_fold_and_match():
    """torchao's own `_choose_scale_float8(scale_dtype=float8_e8m0fnu)` (`exp2(round(log2(s)))`) on float32
    activations folds as `per_row, power of two (nearest)`, and that recipe is torchao's arithmetic."""
    quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")

    def torchao_e8m0(x):
        scale = quant_primitives._choose_scale_float8(x, [1, x.shape[-1]], scale_dtype=torch.float8_e8m0fnu)
        return quant_primitives._quantize_affine_float8(x, scale), scale

    inputs = _inputs(0, torch.float32)
    stats, graph = _compile_on_fake_group(lambda x, r, w, g: block(x, r, w, g, torchao_e8m0), *inputs)
    recipe = Fp8Recipe("per_row", power_of_two="nearest")
    assert stats.fp8_quantizations_folded == 1 and recipe_of(_fused_node(graph).args, {}) == recipe
    normed, _ = add_rmsnorm(inputs[0], None, inputs[2], 1e-6)
    q, s = quantize_fp8(normed, recipe)
    q_ao, s_ao = torchao_e8m0(normed)
    assert torch.equal(q.view(torch.uint8), q_ao.view(torch.uint8)) and torch.equal(s, s_ao)
