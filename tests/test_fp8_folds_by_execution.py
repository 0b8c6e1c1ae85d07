"""FP8 folds decided by running the code (issue 39): the two wrong answers of the matcher that read op
spellings, the spellings it missed, the probe rows' power to tell recipes apart, a structure check turned
off on purpose (the executed check alone still refuses), runtime parameters, and one search per structure.

Each quantization here is user code, written as its source writes it; compiled on a fake process group
(one process, no communication) its outputs must equal eager's bit for bit, folded or not.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from toy_graphs import GraphCapture, compile_and_run, fake_process_group, rmsnorm_transformers

from fxfuse.backend import FxfuseBackend
from fxfuse.op.fp8_recipe import FP8_DTYPE, GRAPH_BOUND_MARK, Fp8Limits, Fp8Recipe, cast_saturates, dynamic_scales, quantize_fp8, rounded_to
from fxfuse.op.fp8_schema import FP8_OPS, argument, recipe_of
from fxfuse.passes import fp8_recipe_search, fp8_region
from fxfuse.passes.config import FAST_ALLREDUCE, PATTERNS
from fxfuse.passes.fp8_epilogue import FP8_REASON
from fxfuse.passes.fp8_probes import parameter_draws, probe_rows

FP8_MAX = torch.finfo(FP8_DTYPE).max  # a module constant: dynamic=True makes it a graph input
WITHOUT_TIER_B = [p for p in PATTERNS if p != FAST_ALLREDUCE]  # the site stays fused, its FP8 reason on it


def lossy_maximum(n):
    """Issue 39, wrong answer 1: the maximum of the fp16 values rounded to bfloat16 (a lossy cast, not an upcast)."""
    amax = n.to(torch.bfloat16).abs().amax(-1, keepdim=True).float()
    scale = amax / 448
    return (n.float() / scale).clamp(-448, 448).to(FP8_DTYPE), scale


def whole_group_pad(x):
    """Issue 39, wrong answer 2: `(0, 128 - cols % 128)` pads a whole group where cols is a multiple of 128."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, 128 - cols % 128)).view(rows, -1, 128)
    scale = padded.abs().amax(dim=-1).clamp_min(1e-12) / 448.0
    quantized = (padded / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8_DTYPE)
    return quantized.view(rows, -1)[:, :cols], scale


def vllm_ue8m0_group(x):
    """vLLM's UE8M0 group quantization: the scale rounded up to a power of two, then bounded below."""
    grouped = x.view(-1, x.shape[-1] // 128, 128)
    absmax = grouped.abs().max(dim=-1, keepdim=True)[0].float()
    scales = torch.exp2(torch.ceil(torch.log2(absmax / FP8_MAX))).clamp(min=1.0 / (FP8_MAX * 512.0))
    return (grouped / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(x.shape), scales.squeeze(-1)


def pow_scalar_base(x):
    """A power-of-two scale written with a scalar base."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8_DTYPE), scale


def block(x, residual, weight, group, quantize):
    hidden = funcol.all_reduce(x, "sum", group) + residual
    quantized, scales = quantize(rmsnorm_transformers(hidden, weight, 1e-6))
    return quantized, scales, hidden


def _inputs(dtype, tokens=4, hidden=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g).to(dtype), torch.randn(tokens, hidden, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype))


def _bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def _compiled_and_eager(quantize, inputs, inner="eager", dynamic=False, patterns=PATTERNS):
    """(stats, FP8 reasons on the graph's nodes, compiled outputs, eager outputs) on a fake process group."""
    with fake_process_group() as group:
        def program(x, r, w):
            return block(x, r, w, group.group_name, quantize)

        backend = GraphCapture(patterns=patterns) if inner == "capture" else FxfuseBackend(inner=inner, patterns=patterns)
        backend, got = compile_and_run(program, *inputs, backend=backend, dynamic=dynamic)
        expected = program(*inputs)
    reasons = [n.meta[FP8_REASON] for g in getattr(backend, "graphs", []) for n in g.graph.nodes if FP8_REASON in n.meta]
    return backend.records[-1].stats, reasons, got, expected


def _assert_equal_to_eager(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(_bits(a), _bits(b))


WRONG_ANSWERS = {
    "lossy_maximum": (lossy_maximum, torch.float16, "scale"),
    "whole_group_pad": (whole_group_pad, torch.bfloat16,
                        "the graph's scales have the shape [4, 3], which no grouping of the op gives: [4, 1] (per_row); "
                        "[4, 2] (per_group 128)"),
}


@pytest.mark.parametrize("name", WRONG_ANSWERS)
def test_the_two_wrong_answers_are_refused_and_equal_eager(name):
    quantize, dtype, detail = WRONG_ANSWERS[name]
    stats, _, got, expected = _compiled_and_eager(quantize, _inputs(dtype))
    assert stats.fp8_quantizations_folded == 0
    _assert_equal_to_eager(got, expected)
    _, reasons, _, _ = _compiled_and_eager(quantize, _inputs(dtype), inner="capture", patterns=WITHOUT_TIER_B)
    assert len(reasons) == 1 and "no recipe of the fused op computes this quantization" in reasons[0] and detail in reasons[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG_ANSWERS)
def test_the_two_wrong_answers_under_inductor_too(name):
    """With Inductor as the inner compiler the quantization stays Inductor's: fxfuse's outputs are plain Inductor's
    (whose own FP8 codes may differ from eager's by a step)."""
    quantize, dtype, _ = WRONG_ANSWERS[name]
    stats, _, got, _ = _compiled_and_eager(quantize, _inputs(dtype), inner="inductor")
    assert stats.fp8_quantizations_folded == 0
    with fake_process_group() as group:
        _, inductor_alone = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, quantize), *_inputs(dtype),
                                            backend="inductor")
    _assert_equal_to_eager(got, inductor_alone)


MISSED = {
    "vllm_ue8m0_group": (vllm_ue8m0_group, Fp8Recipe("per_group", 128, min_scale=rounded_to(1 / (448 * 512), torch.float32),
                                                     power_of_two="ceil", bound_after_power_of_two=True)),
    "pow_scalar_base": (pow_scalar_base, Fp8Recipe("per_row", power_of_two="ceil")),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", MISSED)
def test_the_missed_spellings_fold_bit_for_bit(name, dynamic):
    """Issue 39's two refused spellings, static and `dynamic=True`: folded, with the recipe named, and equal to eager."""
    quantize, recipe = MISSED[name]
    stats, _, got, expected = _compiled_and_eager(quantize, _inputs(torch.bfloat16), dynamic=dynamic)
    assert stats.fp8_quantizations_folded == 1
    _assert_equal_to_eager(got, expected)
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, quantize), *_inputs(torch.bfloat16),
                                     backend=GraphCapture(patterns=PATTERNS), dynamic=dynamic)
    (node,) = [n for op in FP8_OPS for n in capture.graphs[0].graph.find_nodes(op="call_function", target=op)]
    # torch 2.15 computes vLLM's bound 1 / (FP8_MAX * 512) in the graph from the lifted FP8_MAX: the op takes it so
    from_graph = dataclasses.replace(recipe, min_scale=GRAPH_BOUND_MARK, bounds_from_graph="min_scale")
    assert recipe_of(node.args, node.kwargs) in ((recipe, from_graph) if dynamic and recipe.min_scale else (recipe,))


def _lifted_source(node):
    """The graph input a one-value runtime node is computed from (through casts and arithmetic with constants)."""
    while node.op != "placeholder":
        (node,) = [arg for arg in node.all_input_nodes if arg.op != "get_attr" and "full" not in str(arg.target)]
    return node


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_probes_tell_every_recipe_apart(dtype):
    """Recipes that differ in any field give different codes or scales on the probe rows, unless they compute the
    same values by arithmetic: a clamp to +-448 and none where the cast saturates, the order of a bound and the
    power-of-two rounding when the bound is itself a power of two, and a bound on the maximum below what the
    bound on the scale already gives."""
    bounds = [rounded_to(1e-4, torch.float32), rounded_to(1 / (448 * 512), torch.float32), 2.0**-12]
    probes, _ = probe_rows(256, dtype, (64, 128), tuple(bounds))
    sixteen_bit = torch.bfloat16 if dtype == torch.float32 else dtype
    outputs = {}
    for scaling, group in (("per_row", 0), ("per_group", 64), ("per_group", 128)):
        for min_amax, scale_dtype, min_scale, rounding, reciprocal, saturate in itertools.product(
                (0.0, *bounds), (torch.float32, sixteen_bit), (0.0, *bounds), ("none", "ceil", "floor", "nearest"),
                (False, True), (True, False)):
            for after in ([False, True] if min_scale and rounding != "none" else [False]):
                recipe = Fp8Recipe(scaling, group, min_amax, scale_dtype, min_scale, rounding, reciprocal, saturate, after)
                codes, scales = quantize_fp8(probes, recipe)
                key = (codes.view(torch.uint8).numpy().tobytes(), scales.numpy().tobytes())
                outputs.setdefault(key, []).append(recipe)

    tiny = float(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps)  # the smallest nonzero maximum

    def canonical(recipe: Fp8Recipe) -> Fp8Recipe:
        same = dict(saturate=True) if cast_saturates() else {}
        if recipe.bound_after_power_of_two and recipe.min_scale == 2.0**-12:
            same["bound_after_power_of_two"] = False
        powers_only = recipe.power_of_two != "none" and (not recipe.bound_after_power_of_two or recipe.min_scale == 2.0**-12
                                                         or not _reciprocal_matters(dtype, recipe.min_scale, recipe.scale_dtype))
        if powers_only and max(recipe.min_scale, recipe.min_amax / 448, tiny / 448) >= 2.0**-125:
            same["reciprocal"] = False  # x / 2**k and x * 2**-k are one number where 2**-k is finite
        without = Fp8Recipe(**{**recipe.__dict__, **same, "min_amax": 0.0})
        if recipe.min_amax and torch.equal(dynamic_scales(torch.tensor([recipe.min_amax]), without),
                                           dynamic_scales(torch.tensor([0.0]), without)):
            same["min_amax"] = 0.0  # the scale's bound alone gives a group of that maximum the scale of a zero group
        return Fp8Recipe(**{**recipe.__dict__, **same})

    for recipes in outputs.values():
        assert len({canonical(r) for r in recipes}) == 1, recipes


def _reciprocal_matters(dtype: torch.dtype, scale: float, scale_dtype: torch.dtype) -> bool:
    """Whether some value of a 16-bit `dtype` (every one tried) casts to another e4m3 code when multiplied by
    the reciprocal of `scale` (rounded to `scale_dtype`) than when divided by it; True for float32 values."""
    if dtype == torch.float32:
        return True
    every = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16).view(dtype).float()
    divisor = torch.tensor(scale, dtype=torch.float64).to(scale_dtype).float()
    return bool(((every / divisor).to(FP8_DTYPE).view(torch.uint8) != (every * divisor.reciprocal()).to(FP8_DTYPE).view(torch.uint8)).any())


def test_parameters_take_every_value_and_differ_within_a_draw():
    assert parameter_draws(0) == [()]
    draws = parameter_draws(2)
    assert all(a != b for a, b in draws) and {a for a, _ in draws} == {b for _, b in draws} == {448.0, 0.37, 2.7, 1000.0, 2.0**-15}


COLUMN_MAXIMA = {
    "columns": lambda n: (lambda s: ((n.float() / s).clamp(-448, 448).to(FP8_DTYPE), s))(n.float().abs().amax(0, keepdim=True) / 448),
    "lossy_maximum": lossy_maximum,
    "whole_group_pad": whole_group_pad,
}


@pytest.mark.parametrize("name", COLUMN_MAXIMA)
def test_with_the_structure_checks_off_the_executed_check_still_refuses(name, monkeypatch):
    """Mutation test: the graph walk's op and row checks turned off (every op allowed, every reshape and maximum
    taken to keep rows apart): running the code on the probe rows still finds that no recipe computes it."""
    monkeypatch.setattr(fp8_region, "_check_op", lambda node, normed: None)
    fp8_recipe_search._SEARCHES.clear()
    dtype = torch.float16 if name == "lossy_maximum" else torch.bfloat16
    stats, reasons, got, expected = _compiled_and_eager(COLUMN_MAXIMA[name], _inputs(dtype), inner="capture",
                                                        patterns=WITHOUT_TIER_B)
    assert stats.fp8_quantizations_folded == 0
    assert len(reasons) == 1 and "no recipe of the fused op computes this quantization" in reasons[0], reasons
    _assert_equal_to_eager(got, expected)
    fp8_recipe_search._SEARCHES.clear()


def sglang_group(x):
    """SGLang's per-group quantization, reading the module constant FP8_MAX (a graph input under `dynamic=True`)."""
    flat = x.reshape(x.numel() // 128, 128)
    amax = flat.abs().max(dim=-1, keepdim=True)[0].clamp(min=1e-10).to(torch.float32)
    scale = amax / FP8_MAX
    quantized = (flat / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    return quantized.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // 128)


class _SglangGroupModel(torch.nn.Module):
    """`sites` blocks quantized by `sglang_group`; the norm weight's width specializes the row width, as in a model."""

    extra_inputs = ()

    def __init__(self, group_name, sites=1):
        super().__init__()
        self.weight = torch.nn.Parameter(_inputs(torch.bfloat16)[2], requires_grad=False)
        self.group_name, self.sites = group_name, sites

    def forward(self, x, residual):
        return self.chain(x, residual, sglang_group)

    def chain(self, x, residual, quantize):
        """`sites` blocks, each fed the previous one's codes: (codes, scales) per site, then the residual."""
        outputs = []
        for _ in range(self.sites):
            quantized, scales, residual = block(x, residual, self.weight, self.group_name, quantize)
            outputs += [quantized, scales]
            x = quantized.float().to(residual.dtype)
        return *outputs, residual


def test_a_runtime_fp8_maximum_is_the_ops_divisor_and_clamp_bound():
    """`dynamic=True` makes the module constant FP8_MAX a graph input; on torch 2.15 the clamp reads it as a tensor
    (`clamp_max.Tensor`) too. The op gets that input as its divisor and clamp bound, and reads it when it runs."""
    with fake_process_group() as group:
        model = _SglangGroupModel(group.group_name)
        capture, got = compile_and_run(model, *_inputs(torch.bfloat16)[:2], backend=GraphCapture(patterns=PATTERNS),
                                       dynamic=True)
        expected = model(*_inputs(torch.bfloat16)[:2])
    assert capture.records[-1].stats.fp8_quantizations_folded == 1
    (node,) = [n for op in FP8_OPS for n in capture.graphs[0].graph.find_nodes(op="call_function", target=op)]
    divisor, clamp_bound = argument(node.args, node.kwargs, "scale_divisor"), argument(node.args, node.kwargs, "clamp_bound")
    assert divisor is not None and _lifted_source(divisor).op == "placeholder"
    if clamp_bound is not None:  # a tensor clamp (torch 2.15): the op clamps to the same input's value
        assert _lifted_source(clamp_bound) is _lifted_source(divisor)
    _assert_equal_to_eager(got, expected)


def test_a_runtime_clamp_bound_is_what_the_op_clamps_to():
    """The op's clamp bound and divisor, given as 0-dim CPU tensors, are read when it runs: other values than 448
    clamp and divide by them, as the graph would."""
    x = torch.randn(3, 256) * 5
    for value in (448.0, 240.0, 3.5):
        codes, scales = quantize_fp8(x, Fp8Recipe("per_row"), limits=Fp8Limits(value, value))
        reference_scales = x.abs().amax(-1, keepdim=True) / value
        reference = (x / reference_scales).clamp(-value, value).to(FP8_DTYPE)
        assert torch.equal(scales, reference_scales) and torch.equal(codes.view(torch.uint8), reference.view(torch.uint8))


def test_sites_of_one_structure_share_one_search():
    """Two sites quantized alike: one search (the second site's structure is a hit)."""
    def two_sites(x, r, w, group):
        quantized, scales, hidden = block(x, r, w, group, pow_scalar_base)
        return quantized, scales, block(quantized.float().to(x.dtype), hidden, w, group, pow_scalar_base)

    fp8_recipe_search._SEARCHES.clear()
    before = fp8_recipe_search.SEARCHES.runs
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: two_sites(x, r, w, group.group_name), *_inputs(torch.bfloat16),
                                     backend=GraphCapture(patterns=PATTERNS))
    assert capture.records[-1].stats.fp8_quantizations_folded == 2
    assert fp8_recipe_search.SEARCHES.runs - before == 1


class _LazilySharedBoundModel(_SglangGroupModel):
    """Sites whose quantizations clamp to `-limit`, computed inside the first one and reused by the others
    (as torch 2.15's trace of `_SglangGroupModel` has it after common-subexpression elimination)."""

    extra_inputs = (torch.tensor(FP8_MAX),)  # limit

    def forward(self, x, residual, limit):
        shared = {}

        def quantize(n):
            flat = n.reshape(n.numel() // 128, 128)
            scale = flat.abs().amax(-1, keepdim=True).float() / limit
            if "lower" not in shared:
                shared["lower"] = -limit
            quantized = (flat / scale).clamp(min=shared["lower"], max=limit).to(FP8_DTYPE)
            return quantized.reshape(n.shape), scale.reshape(*n.shape[:-1], n.shape[-1] // 128)

        return self.chain(x, residual, quantize)


@pytest.mark.parametrize("model_class, dynamic", [(_SglangGroupModel, True), (_LazilySharedBoundModel, False)],
                         ids=["sglang_dynamic", "lazily_shared_bound"])
def test_sites_that_share_a_value_of_the_graph_share_one_search(model_class, dynamic):
    """Three sites read one value of the graph through one shared `-limit` that sits inside the first site's
    quantization and before the others': still one structure, one search, and eager's values."""
    fp8_recipe_search._SEARCHES.clear()
    before = fp8_recipe_search.SEARCHES.runs
    with fake_process_group() as group:
        model = model_class(group.group_name, sites=3)
        inputs = (*_inputs(torch.bfloat16)[:2], *model.extra_inputs)
        capture, got = compile_and_run(model, *inputs, backend=GraphCapture(patterns=PATTERNS), dynamic=dynamic)
        expected = model(*inputs)
    assert capture.records[-1].stats.fp8_quantizations_folded == 3
    assert fp8_recipe_search.SEARCHES.runs - before == 1
    _assert_equal_to_eager(got, expected)


@pytest.mark.parametrize("recipe, limits", [
    (Fp8Recipe("per_group", 128, min_scale=rounded_to(1 / (448 * 512), torch.float32), power_of_two="ceil",
               bound_after_power_of_two=True), Fp8Limits()),
    (Fp8Recipe("per_row", 0, GRAPH_BOUND_MARK, min_scale=GRAPH_BOUND_MARK, bounds_from_graph="min_amax,min_scale"),
     Fp8Limits(240.0, 200.0, 0.5, 1 / (240 * 512))),
    (Fp8Recipe("per_group", 128, min_scale=GRAPH_BOUND_MARK, power_of_two="ceil", bound_after_power_of_two=True,
               bounds_from_graph="min_scale"), Fp8Limits(448.0, 100.0, None, 3e-3)),
], ids=["bound_after_rounding", "every_value_from_the_graph", "scale_bound_from_the_graph_after_rounding"])
def test_the_kernel_takes_the_new_recipe_fields_and_the_graphs_values(recipe, limits):
    """The Triton kernel (Triton's CPU interpreter here; bit for bit on the GPU: tests/gpu/test_fp8_epilogue_gpu.py)
    bounds after rounding and reads the divisor, clamp bound and lower bounds it is given: scales exactly the
    reference's, codes but where the interpreter misrounds a float8 cast."""
    from test_fp8_epilogue import _matches_apart_from_interpreter_misrounding

    from fxfuse.op.fp8_recipe import scale_shape
    from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import quantize_fp8_into

    normed = (torch.randn(6, 512, generator=torch.Generator().manual_seed(3)) *
              torch.tensor([1, 0.01, 1e-4, 3, 0.2, 1e-6])[:, None]).half()
    codes, scales = torch.empty(normed.shape, dtype=FP8_DTYPE), torch.empty(scale_shape(normed.shape, recipe))
    quantize_fp8_into(normed, recipe, None, codes, scales, limits)
    expected_codes, expected_scales = quantize_fp8(normed, recipe, None, limits)
    assert torch.equal(scales, expected_scales)
    assert _matches_apart_from_interpreter_misrounding(codes.float(), expected_codes.float())
