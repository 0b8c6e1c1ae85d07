"""CPU tests of `fxfuse bench fallback`: its options, the quantization blocks against their float32
reference (and the check catching wrong outputs), what it records of the fxfuse backend's graphs, the
compile-and-check path of a point on a one-rank gloo group (eager after the passes), and the report
(rows, tables per quantization and shape mode, failures). The CUDA-graph timing runs on a GPU
(tests/gpu/test_fallback_gpu.py, `PARTS=quantbench scripts/gpu_check.sh`)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from fxfuse.bench.arguments import DEFAULT_FALLBACK_TOKENS, FALLBACK_MODES, FALLBACK_QUANT, add_fallback_arguments
from fxfuse.bench.fallback import FP8_OP, NORM_OP, fused_op_names, graph_fusion, main
from fxfuse.bench.fallback_blocks import (
    BF16_TOLERANCE,
    BLOCKS,
    FP8,
    SCALE_TOLERANCE,
    Reference,
    block_inputs,
    check_outputs,
    fp32_reference,
)
from fxfuse.bench.fallback_report import failures, markdown, overview_rows
from fxfuse.command_line import CommandParser
from fxfuse.runner.launch import run_on_ranks

CPU = torch.device("cpu")


def parse(argv):
    parser = CommandParser(prog="fxfuse bench fallback")
    add_fallback_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_sweep_every_quantization_and_both_shape_modes():
    args = parse([])
    assert args.tokens == DEFAULT_FALLBACK_TOKENS == tuple(2**i for i in range(13))
    assert args.hidden == (7168, 4096) and args.quant == list(FALLBACK_QUANT) == [
        "none", "group", "row", "tensor", "row_reciprocal", "group_ue8m0", "clamp_scale", "second_rmsnorm"]
    assert args.without == [] and parse(["--without", "fp8_epilogue"]).without == ["fp8_epilogue"]
    assert args.modes == list(FALLBACK_MODES) == ["static", "dynamic"]
    assert (args.repeats, args.iters, args.time_budget_s, args.input_sets) == (30, 20, None, 0)
    assert tuple(BLOCKS) == FALLBACK_QUANT  # one block per kind, in report order
    assert parse(["--quant", "row,tensor", "--modes", "static"]).quant == ["row", "tensor"]


@pytest.mark.parametrize("argv, message", [
    (["--quant", "group", "--hidden", "4096,100"], "--quant group needs hidden sizes that are multiples of 128 (got 100)"),
    (["--quant", "int4"], "argument --quant: expected a comma-separated subset of none, group, row, tensor, row_reciprocal, "
                          "group_ue8m0, clamp_scale, second_rmsnorm, got 'int4'"),
    (["--without", "fp8"], "argument --without: expected a comma-separated subset of merge_allreduce, "
                           "allreduce_residual_rmsnorm, allreduce_rmsnorm, fp8_epilogue, fast_allreduce, got 'fp8'"),
    (["--modes", "fast"], "argument --modes: expected a comma-separated subset of static, dynamic, got 'fast'"),
    (["--time-budget-s", "0"], "argument --time-budget-s: must be a finite number above 0"),
    (["--tokens", "0"], "argument --tokens: each value must be between 1 and"),
    (["--input-sets", "-1"], "argument --input-sets: must be at least 0 (got -1)"),
])
def test_bad_options_are_one_error_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxfuse: error: ") and message in err and err.count("\n") == 1


def test_without_cuda_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--quant", "none"]) == 2
    assert capsys.readouterr().err == "fxfuse: error: fxfuse bench fallback needs a CUDA GPU\n"


def test_the_static_scale_is_calibrated_with_headroom():
    *_, inv_scale = block_inputs("tensor", 8, 256, CPU)
    reference = fp32_reference("tensor", block_inputs("tensor", 8, 256, CPU))
    assert inv_scale.dtype == torch.float32 and inv_scale.dim() == 0
    assert float(reference.normed.abs().max() * inv_scale) == pytest.approx(448 / 1.25)


def _reference_outputs(quant: str, reference: Reference):
    """Outputs as a correct block returns them, made from the float32 reference itself."""
    hidden = reference.hidden.bfloat16()
    if quant == "none":
        return reference.normed.bfloat16(), hidden
    scales = reference.scales
    if quant == "group_ue8m0":  # rounded up to a power of two, as the block's own scales are
        scales = torch.exp2(torch.ceil(torch.log2(scales))).squeeze(-1)
    expanded = scales.repeat_interleave(128, dim=1) if quant.startswith("group") else scales
    q = (reference.normed / expanded).clamp(-448, 448).to(FP8)
    return (q, hidden) if quant == "tensor" else (q, scales, hidden)


@pytest.mark.parametrize("quant", ["group", "row", "tensor", "row_reciprocal", "group_ue8m0"])
def test_the_check_passes_exact_outputs_and_catches_wrong_ones(quant):
    reference = fp32_reference(quant, block_inputs(quant, 16, 512, CPU))
    good = _reference_outputs(quant, reference)
    result = check_outputs(quant, good, reference)
    assert result["ok"] and result["dequant_err_over_bound"] <= 0.5  # rounding to e4m3: half a step at most
    q = good[0]
    shifted = (q.float() * 1.3).clamp(-448, 448).to(FP8)  # every value about two e4m3 steps off
    assert not check_outputs(quant, (shifted, *good[1:]), reference)["ok"]
    residual_off = (*good[:-1], good[-1] * 1.1)
    assert check_outputs(quant, residual_off, reference)["residual_rel_err"] > BF16_TOLERANCE
    assert not check_outputs(quant, residual_off, reference)["ok"]
    if quant != "tensor":  # the scales are the block's own output: checked tightly
        off = good[1] * (1 + 2 * SCALE_TOLERANCE)
        result = check_outputs(quant, (q, off, good[2]), reference)
        if quant == "group_ue8m0":  # no longer a power of two, and not within [scale, 2 * scale] of the reference
            assert not result["scale_power_of_two"] and not result["ok"]
        else:
            assert result["scale_rel_err"] == pytest.approx(2 * SCALE_TOLERANCE, rel=1e-3) and not result["ok"]
        with pytest.raises(ValueError, match="returned scales of shape"):
            check_outputs(quant, (q, good[1][:, :1].expand(-1, 3), good[2]), reference)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        check_outputs(quant, (q.float(), *good[1:]), reference)


def test_the_check_fails_on_nan():
    reference = fp32_reference("none", block_inputs("none", 4, 256, CPU))
    normed, hidden = _reference_outputs("none", reference)
    assert check_outputs("none", (normed, hidden), reference)["ok"]
    normed[0, 0] = float("nan")
    assert not check_outputs("none", (normed, hidden), reference)["ok"]


def test_quant_blocks_match_their_float32_reference(monkeypatch):
    """Every block eagerly (the all-reduce of one rank: the identity), checked against float32; the group
    block also against the model code's own activation quantizer (the same spelling, so the same bits).
    The blocks on a real one-rank group, compiled: `test_every_point_compiles_fuses_the_site_and_checks_out`."""
    import fxfuse.bench.fallback_blocks as blocks
    from fxfuse.models.quant.reference import quantize_activations

    monkeypatch.setattr(blocks.funcol, "all_reduce", lambda x, op, group: x.clone())
    for quant, fn in BLOCKS.items():
        for tokens, hidden in ((1, 256), (3, 1024), (64, 7168)):
            inputs = block_inputs(quant, tokens, hidden, CPU)
            outputs = fn(*inputs, "one rank")
            result = check_outputs(quant, outputs, fp32_reference(quant, inputs))
            assert result["ok"], (quant, tokens, hidden, result)
            if quant == "group":
                normed, _ = BLOCKS["none"](*inputs, "one rank")
                q, scales = quantize_activations(normed, 128)
                assert torch.equal(q.view(torch.uint8), outputs[0].view(torch.uint8)) and torch.equal(scales, outputs[1])


def fake_record(ops: dict[str, int], sites: int = 1, fast: int = 0):
    return SimpleNamespace(after=SimpleNamespace(op_counts=Counter(ops)),
                           stats=SimpleNamespace(allreduces_before=sites, fast_all_reduces=fast))


def test_fused_op_names_find_the_fp8_variant_by_name_where_it_exists():
    names = fused_op_names()
    assert names[0] == NORM_OP
    assert (FP8_OP in names) is hasattr(torch.ops.fxfuse, "allreduce_residual_rmsnorm_fp8")


def test_graph_fusion_counts_the_fused_op_nodes(monkeypatch):
    import fxfuse.bench.fallback as fallback

    monkeypatch.setattr(fallback, "fused_op_names", lambda: [NORM_OP, FP8_OP])  # as once the op has the variant
    assert graph_fusion(fake_record({NORM_OP: 1, "aten.amax": 1}), "group") == {
        "allreduce_sites": 1, "fused_ops": {NORM_OP: 1}, "site_fused": True, "tier": "a", "quant_fused": False}
    assert graph_fusion(fake_record({FP8_OP: 1}), "row") == {
        "allreduce_sites": 1, "fused_ops": {FP8_OP: 1}, "site_fused": True, "tier": "a", "quant_fused": True}
    assert graph_fusion(fake_record({NORM_OP: 1}), "none")["quant_fused"] is None
    assert graph_fusion(fake_record({"fxfuse.all_reduce": 1}, fast=1), "clamp_scale") == {
        "allreduce_sites": 1, "fused_ops": {}, "site_fused": False, "tier": "b", "quant_fused": False}
    assert graph_fusion(fake_record({"_c10d_functional.all_reduce": 1}), "none")["tier"] == "c"
    assert graph_fusion(fake_record({}, sites=0), "none")["tier"] == "c"


#: (kind, passes left out) -> the site's tier: every FP8 kind folds into the op (issue 29) unless the
#: fp8_epilogue pass is left out; a clamp and a scale or a second norm go to tier (b).
EXPECTED_TIERS = {
    **{(quant, ()): "a" for quant in ("none", "group", "row", "tensor", "row_reciprocal", "group_ue8m0")},
    **{(quant, ("fp8_epilogue",)): "b" for quant in ("group", "row", "tensor", "row_reciprocal", "group_ue8m0")},
    ("clamp_scale", ()): "b", ("second_rmsnorm", ()): "b",
}


def compile_and_check_on_one_rank(ctx) -> dict:
    """Every quantization kind compiled both ways (eager after the passes), static and dynamic, at 1, 2
    and 8 tokens, with every pass and (FP8 kinds) without fp8_epilogue: each point's row (checks,
    fusion) and each mode's fusion summary."""
    from fxfuse.bench.fallback import Variants, checked_point

    out = {}
    with torch.no_grad():
        for quant, without in EXPECTED_TIERS:
            for dynamic in (False, True):
                variants = Variants(quant, dynamic, compiler="eager", without=without)
                rows = [checked_point(variants, tokens, 256, CPU, ctx.group.group_name)[0] for tokens in (1, 2, 8)]
                out[(quant, without, dynamic)] = (rows, variants.summary(256))
    return out


@pytest.mark.slow
def test_every_point_compiles_tiers_the_site_and_checks_out():
    (results,) = run_on_ranks(compile_and_check_on_one_rank, 1, timeout_s=600)
    assert set(BLOCKS) == {quant for quant, _ in EXPECTED_TIERS}
    for (quant, without, dynamic), (rows, summary) in results.items():
        assert [r["tokens"] for r in rows] == [1, 2, 8] and all(r["ok"] for r in rows), rows
        assert all(set(r["check"]) == {"inductor", "fxfuse"} for r in rows)
        # static shapes: one compile per point; dynamic: the 1-token graph, then one for 2 and 8
        assert len(summary["graphs"]) == (2 if dynamic else 3), summary
        tier = EXPECTED_TIERS[quant, without]
        for graph in summary["graphs"]:
            assert graph["allreduce_sites"] == 1 and graph["tier"] == tier, (quant, without, graph)
            assert sum(graph["fused_ops"].values()) == (tier == "a") and graph["site_fused"] == (tier == "a")
            # the quantization in the op exactly when the graph holds the FP8 variant
            assert graph["quant_fused"] == (None if quant == "none" else FP8_OP in graph["fused_ops"])
            assert graph["quant_fused"] in (None, tier == "a" and quant not in ("clamp_scale", "second_rmsnorm"))


def row(quant, dynamic, tokens, inductor_us, fused_us, ok=True, fp8=False):
    check = {"residual_rel_err": 1e-3, "dequant_err_over_bound": 0.5 if ok else 1.5, "ok": ok}
    fused_ops = {FP8_OP if fp8 else NORM_OP: 1}
    return {"tokens": tokens, "hidden": 7168, "quant": quant, "dynamic": dynamic, "ok": ok,
            "inductor_us": inductor_us, "inductor_p25": inductor_us, "inductor_p75": inductor_us,
            "fused_us": fused_us, "fused_p25": fused_us, "fused_p75": fused_us, "ratio": fused_us / inductor_us,
            "input_sets": 10 if tokens < 1024 else 7,
            "check": {"inductor": dict(check, ok=True), "fxfuse": check},
            "fusion": {"allreduce_sites": 1, "fused_ops": fused_ops, "site_fused": True, "tier": "a", "quant_fused": fp8}}


def fake_report():
    rows = [row("group", False, 1, 10.0, 9.0), row("group", False, 1024, 24.0, 30.0, ok=False),
            row("group", True, 1, 11.0, 9.0), row("group", True, 1024, 60.0, 40.0),
            row("row", False, 1, 10.0, 8.0, fp8=True)]
    rows.append({"tokens": 2048, "hidden": 7168, "quant": "row", "dynamic": False, "ok": False,
                 "error": "RuntimeError: lowering failed"})
    fusion = [{"hidden": 7168, "quant": "group", "dynamic": False, "graphs": [r["fusion"] for r in rows[:2]]},
              {"hidden": 7168, "quant": "group", "dynamic": True, "graphs": [r["fusion"] for r in rows[2:4]]},
              {"hidden": 7168, "quant": "row", "dynamic": False, "graphs": [rows[4]["fusion"]]}]
    return {"gpu": "NVIDIA H200", "stamp": "20261202-120000", "date": "2026-12-02T12:00:00+00:00",
            "command": "fxfuse bench fallback", "versions": {"torch": "2.11.0"}, "dtype": "bfloat16", "iters": 10,
            "input_sets": 0, "l2_bytes": 50 << 20,
            "repeats": 20, "time_budget_s": 400.0, "native_fallback": True, "rows": rows, "fusion": fusion,
            "host_cost": [], "op_parts": [], "first_call_s": 12.0, "wall_s": 40.0,
            "skipped": [{"tokens": 4096, "hidden": 7168, "quant": "row", "dynamic": False}]}


def test_skipped_points_are_summarised_as_what_to_run_again():
    from fxfuse.bench.fallback_report import skipped_summary

    points = [{"tokens": t, "hidden": 4096, "quant": q, "dynamic": d} for q, d in (("row", True), ("tensor", False))
              for t in (1, 2, 4)]
    assert skipped_summary(points) == "hidden 4096 row dynamic at 1,2,4 tokens; hidden 4096 tensor static at 1,2,4 tokens"


def test_failures_name_each_failed_point():
    assert failures(fake_report()) == [
        "group static hidden 7168 tokens 1024: fxfuse outside the bounds (residual_rel_err 0.001, dequant_err_over_bound 1.5)",
        "row static hidden 7168 tokens 2048: RuntimeError: lowering failed",
    ]
    unfused = fake_report()
    unfused["rows"][0]["fusion"].update(site_fused=False, tier="c")
    assert "group static hidden 7168 tokens 1: the fxfuse variant left the all-reduce site to Inductor" in failures(unfused)[0]


def test_overview_gives_each_modes_ratio_range_and_inductors_dynamic_slowdown():
    group, row_kind = overview_rows(fake_report())
    assert group == {"quant": "group", "hidden": 7168, "failed": 1, "slower": 1, "faster": 3, "static": (0.9, 1.25),
                     "dynamic": (pytest.approx(40 / 60), pytest.approx(9 / 11)),
                     "inductor_dynamic_over_static": pytest.approx((1.1 * 2.5) ** 0.5)}
    assert row_kind["dynamic"] is None and row_kind["inductor_dynamic_over_static"] is None and row_kind["failed"] == 1
    assert (row_kind["slower"], row_kind["faster"]) == (0, 1)
    overlapping = fake_report()
    overlapping["rows"][0].update(fused_p75=10.5)  # 9.0 median, but its spread reaches Inductor's 10.0
    assert (overview_rows(overlapping)[0]["slower"], overview_rows(overlapping)[0]["faster"]) == (1, 2)


def test_markdown_has_a_table_per_quantization_and_mode():
    text = markdown(fake_report())
    assert "- check, both variants at every point, against float32" in text and "4 of 6 points passed" in text
    assert "- 1 point(s) skipped, the time budget of 400 s spent: hidden 7168 row static at 4096 tokens" in text
    assert "| group | 7168 | 0.900-1.250 | 0.667-0.818 | 1 / 3 | 1.66 | 1 |" in text
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == [
        "## FP8 per token group of 128, dynamic scales: static shapes (dynamic=False, one compile per token count)",
        "## FP8 per token group of 128, dynamic scales: dynamic shapes (dynamic=True, one graph for every token count above 1)",
        "## FP8 per row, dynamic scales (torchao's PerRow arithmetic): static shapes (dynamic=False, one compile per token count)",
    ]
    assert ("- fxfuse graphs compiled: 2; the all-reduce site fused in 2; fused-op nodes per graph: "
            "fxfuse.allreduce_residual_rmsnorm x1; quantization fused into the op: no (Inductor quantizes the op's "
            "normed output)") in text
    assert "quantization fused into the op: yes, in every graph" in text
    assert "| 7168 | 1024 | 24.00 (24.00-24.00) | 30.00 (30.00-30.00) | 1.250 | FAILED fxfuse: " in text
    assert "| 7168 | 2048 | - | - | - | ERROR: RuntimeError: lowering failed |" in text
    assert ("- inputs: the calls cycled through 7-10 copies of input and residual per point (--input-sets 0: enough "
            "to cover twice the L2 cache of 50 MiB, at most 10; 1 = L2-hot)") in text
    assert "FxfuseBackend(fuse_without_fast_kernel=True): the site fused (tier a)" in text
    without = fake_report()
    without["fxfuse_without"] = ["fp8_epilogue"]
    assert "FxfuseBackend(fuse_without_fast_kernel=True, patterns without fp8_epilogue)" in markdown(without)
    older = fake_report()
    del older["input_sets"]
    assert "- inputs: every captured call read the same inputs (L2-hot)" in markdown(older)


def test_calls_cycle_through_enough_input_copies_to_miss_the_l2_cache():
    """Auto (0): copies of input and residual until those between two uses of one copy cover twice the L2
    cache, within 1..iters; a count asked for is taken as it is. The copies clone input and residual and
    share the rest; the calls take them in turn."""
    from fxfuse.bench.fallback import cycling_call, input_copies, input_set_count

    l2 = 50 << 20
    point = lambda tokens, hidden: block_inputs("none", tokens, hidden, CPU)  # noqa: E731
    assert input_set_count(point(1024, 4096), 0, 20, l2) == 13  # 8.25 MiB of input and residual per copy
    assert input_set_count(point(4096, 7168), 0, 20, l2) == 2  # 57 MiB per copy
    assert input_set_count(point(1, 4096), 0, 20, l2) == 20  # tiny: as many as there are calls
    assert input_set_count(point(1024, 4096), 3, 20, l2) == 3
    seen = []
    call = cycling_call(lambda *args: seen.append(args), [("a",), ("b",), ("c",)], "group")
    for _ in range(5):
        call()
    assert seen == [("a", "group"), ("b", "group"), ("c", "group"), ("a", "group"), ("b", "group")]
    inputs = block_inputs("tensor", 4, 256, CPU)
    copies = input_copies(inputs, 3)
    assert len(copies) == 3 and copies[0] is inputs
    for copy in copies[1:]:
        assert all(c is not t and torch.equal(c, t) for c, t in zip(copy[:2], inputs[:2]))  # streamed: cloned
        assert all(c is t for c, t in zip(copy[2:], inputs[2:]))  # weight, proj, inverse scale: shared
