"""The FP8 epilogue (issue 22): an FP8 quantization of a fused site's norm output folds into the fused
op's FP8 variant, for the spellings plain PyTorch code writes (this project's per-token-group
quantization, DeepSeek-V3's act_quant arithmetic, torchao's dynamic per-row, a static per-tensor
scale); exact graph counts, exact reasons when it is left out, and numerics equal to eager on two
gloo ranks (CPU: bit for bit, codes and scales). The quantization spellings here are user code,
written independently of the pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from nccl_plan_helpers import use_nccl_plans
from toy_graphs import GraphCapture, compile_and_run, fake_process_group, rmsnorm_transformers

from fxfuse.backend import FxfuseBackend
from fxfuse.op.fp8_recipe import Fp8Recipe, quantize_fp8, scale_shape
from fxfuse.op.fp8_schema import FP8_OPS, allreduce_residual_rmsnorm_fp8
from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.schema import NORM_OPS
from fxfuse.passes.config import FP8_EPILOGUE, PATTERNS
from fxfuse.passes.fp8_epilogue import FP8_REASON
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


def static_multiply(x, inverse_scale):
    return (x.float() * inverse_scale).clamp(-448.0, 448.0).to(FP8), inverse_scale


def static_divide(x, scale):
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def block(x, residual, weight, group, quantize, *scale):
    hidden = funcol.all_reduce(x, "sum", group) + residual
    quantized, scales = quantize(rmsnorm_transformers(hidden, weight, 1e-6), *scale)
    return quantized, scales, hidden


SPELLINGS = {
    "per_group_models_quant": (per_group_models_quant, Fp8Recipe("per_group", 128, 1e-12)),
    "per_group_deepseek": (per_group_deepseek, Fp8Recipe("per_group", 128)),
    "per_row_torchao_spelling": (per_row_torchao_spelling, Fp8Recipe("per_row", 0, 0.0, torch.bfloat16)),
    "static_multiply": (static_multiply, Fp8Recipe("static_mul")),
    "static_divide": (static_divide, Fp8Recipe("static_div")),
}


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
    assert Fp8Recipe(*node.args[5:9]) == recipe and node.args[10] is False  # the bf16 normed output is not needed
    targets = {str(n.target) for n in graph.nodes}
    assert not targets & {"aten.amax.default", "aten.abs.default", "aten.clamp_min.default", "aten.clamp_max.default"}
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
    assert Fp8Recipe(*_fused_node(graph).args[5:9]) == Fp8Recipe("per_group", 128, 1e-12)


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


LEFT_OUT = {
    "e5m2": (_e5m2, "casts to torch.float8_e5m2, not float8_e4m3fn"),
    "other_bound": (_other_bound, "clamps to [240.0], not to +-448"),
    "other_maximum": (_other_maximum, "divides the group maximum by 240.0, not 448"),
    "columns": (_columns, "reduces over dimensions [0], not the last one"),
    "shared_maximum": (_shared_maximum, "inside the FP8 quantization is also used by"),
    "scale_from_the_norm": (_scale_from_the_norm, "the static FP8 scale is computed from the norm's output"),
}


@pytest.mark.parametrize("name", LEFT_OUT)
def test_a_quantization_left_out_keeps_the_site_fused_and_says_why(name):
    quantize, reason = LEFT_OUT[name]
    stats, graph = _compile_on_fake_group(lambda x, r, w, group: block(x, r, w, group, quantize), *_inputs(0))
    assert (stats.fused, stats.fp8_quantizations_folded) == (1, 0)
    (fused,) = [n for n in graph.nodes if str(n.target) == "fxfuse.allreduce_residual_rmsnorm.default"]
    assert reason in fused.meta[FP8_REASON], fused.meta[FP8_REASON]


def test_the_pattern_can_be_disabled():
    stats, _ = _compile_on_fake_group(lambda x, r, w, g: block(x, r, w, g, per_group_deepseek), *_inputs(0),
                                      patterns=[p for p in PATTERNS if p != FP8_EPILOGUE])
    assert (stats.fused, stats.fp8_quantizations_folded) == (1, 0)


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
            assert folded == (name != "per_group_deepseek"), name
            _assert_bit_identical(got, expected, name)


def test_a_flattened_grouping_of_a_symbolic_width_is_left_out():
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, per_group_deepseek), *_inputs(0),
                                     backend=GraphCapture(patterns=PATTERNS), dynamic=True)
        (graph,) = capture.graphs
    (fused,) = [n for n in graph.graph.nodes if n.target in NORM_OPS]
    assert "groups the flattened rows by 128" in fused.meta[FP8_REASON] and "not known to be a multiple" in fused.meta[FP8_REASON]


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
    assert Fp8Recipe(*_fused_node(graph).args[5:9]) == Fp8Recipe("per_row", 0, 0.0, torch.bfloat16)
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
    into the exponent (it returns half the power of two torch and the GPU return), or a subnormal (it
    rounds toward zero, one subnormal step of 2**-9 below). Codes are compared exactly on the GPU."""
    got, expected = got.float(), expected.float()
    differ = got != expected
    carries = (got * 2 == expected) & (torch.log2(expected.abs()) % 1 == 0)
    subnormal = (expected.abs() <= 2**-6) & ((got - expected).abs() <= 2**-9)
    return bool((~differ | carries | subnormal).all())


def _nccl_plan_fp8_on_rank(ctx):
    """The CUDA dispatch's NCCL plan of the FP8 variant on CPU tensors (Triton's interpreter), fp16."""
    from fxfuse.op import cuda_dispatch

    name = use_nccl_plans(ctx)
    out = []
    for spelling, (_, recipe) in SPELLINGS.items():
        x, residual, weight = _inputs(ctx.rank, torch.float16, tokens=3)
        scale = torch.tensor(0.37) if spelling.startswith("static") else None
        for return_normed in (False, True):
            q, *rest = cuda_dispatch.allreduce_residual_rmsnorm_fp8_cuda(x.clone(), residual, weight, 1e-6, name, recipe,
                                                                         scale, return_normed, x_donated=True)
            assert q.dtype == FP8
            out.append((spelling, recipe, scale, return_normed, x, residual, weight, (q.float(), *rest)))
    return out


def test_the_nccl_plan_runs_the_fused_fp8_kernel():
    rank0, rank1 = run_on_ranks(_nccl_plan_fp8_on_rank, 2, timeout_s=300)
    for case0, case1 in zip(rank0, rank1):
        spelling, recipe, scale, return_normed, x0, residual, weight, (q, scales, residual_out, normed) = case0
        expected_normed, expected_residual = add_rmsnorm(x0 + case1[4], residual, weight, 1e-6)
        expected_q, expected_scales = quantize_fp8(expected_normed, recipe, scale)
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
    assert [row.fp8 for row in report.sites] == [
        "fused: per_group 128", "left out: `clamp_max` clamps to [240.0], not to +-448 before the FP8 cast"]
    assert "[FP8 quantization fused: per_group 128]" in report.table()
