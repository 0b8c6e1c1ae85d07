"""Differential test of the FP8 epilogue (issue 29): seeded random FP8 quantizations after a fused site
(tests/fp8_fuzz_cases.py: every recipe, spelled many ways, static and dynamic shapes, and wrong-on-purpose
draws) compiled with the fxfuse backend (eager inner compiler) on 2 gloo ranks, against eager.

For each case: the pass folds exactly the draws it must (`Fp8Case.folds`) and gives the expected reason for
the others; every output (e4m3 codes, scales, the residual sum, the normed output when read) equals eager's
bit for bit (on CPU the fused op's arithmetic is the unfused torch code's). `QUICK_CASES` seeds in the quick
loop, `SLOW_CASES` more under `slow`, in one spawn of the ranks when both are selected (`failures`); other
seeds: `.venv/bin/python tests/test_fp8_fuzz.py FIRST COUNT`.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from fp8_fuzz_cases import Fp8Case, random_case, render
from selection import selected
from toy_graphs import GraphCapture, compile_and_run

from fxfuse.op.schema import NORM_OPS
from fxfuse.passes.config import PATTERNS
from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.passes.fp8_epilogue import FP8_REASON
from fxfuse.passes.site_tiers import TIER_REASON
from fxfuse.runner.launch import run_on_ranks

QUICK_CASES = 24
SLOW_CASES = 240
#: Each test's first seed, number of seeds, and seconds its cases may take.
SEED_RANGES = {
    "test_random_fp8_quantizations_fold_exactly_when_they_should_and_equal_eager": (0, QUICK_CASES, 600),
    "test_more_random_fp8_quantizations": (QUICK_CASES, SLOW_CASES, 3000),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _program(case: Fp8Case):
    namespace = {"torch": torch, "funcol": funcol, "F": F, "FP8_MAX": torch.finfo(torch.float8_e4m3fn).max}
    exec(compile(render(case), f"<fp8 case {case.seed}>", "exec"), namespace)  # noqa: S102 - our own generated source
    return namespace["program"]


def _inputs(case: Fp8Case, rank: int) -> tuple:
    g = torch.Generator().manual_seed(case.seed * 10 + rank)
    common = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    x = (torch.randn(case.tokens, case.hidden, generator=g) * 2).to(dtype)
    x[0, : case.hidden // 4] = 0.0  # with the residual's zeros below: an all-zero group (0 / 0 without a bound)
    residual = torch.randn(case.tokens, case.hidden, generator=common).to(dtype)
    residual[0, : case.hidden // 4] = 0.0
    weight = (1 + 0.1 * torch.randn(case.hidden, generator=common)).to(dtype)
    return x, residual, weight, torch.tensor(0.37 if case.scaling == "static_mul" else 2.7)


def _bits(outputs) -> list:
    """Each output as comparable CPU data: FP8 as its codes (FP8 tensors do not pickle back from a rank)."""
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in outputs]


def check_case(case: Fp8Case, group_name: str, rank: int) -> str | None:
    """What is wrong with `case` compiled against eager and its expected folding, or None."""
    program = _program(case)
    inputs = _inputs(case, rank)
    try:
        capture, got = compile_and_run(lambda *a: program(*a, group_name), *inputs, backend=GraphCapture(PATTERNS),
                                       dynamic=case.dynamic)
    except Exception as error:  # noqa: BLE001 - a crash is a finding, reported with the case
        return f"compile or run failed: {type(error).__name__}: {error}"
    with torch.no_grad():
        expected = program(*inputs, group_name)
    folded = sum(record.stats.fp8_quantizations_folded for record in capture.records)
    reasons = [node.meta.get(FP8_REASON) for graph in capture.graphs for node in graph.graph.nodes
               if node.target in NORM_OPS]  # with the fast_allreduce pattern off: the site stays fused
    reasons += [node.meta.get(TIER_REASON) for graph in capture.graphs for node in graph.graph.nodes
                if node.target is all_reduce]  # else it is in tier (b), the reason on its all-reduce-only op
    if folded != int(case.folds):
        return f"folded {folded}, expected {int(case.folds)} (reasons: {reasons})"
    if not case.folds and not any(reason and expected in reason for reason in reasons for expected in case.reasons):
        return f"left out for {reasons}, expected a reason containing one of {case.reasons}"
    for index, (a, b) in enumerate(zip(_bits(got), _bits(expected), strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"output {index}: {a.dtype} {tuple(a.shape)}, eager {b.dtype} {tuple(b.shape)}"
        if not torch.equal(a.nan_to_num(7.0) if a.is_floating_point() else a, b.nan_to_num(7.0) if b.is_floating_point() else b) \
                or (a.is_floating_point() and not torch.equal(a.isnan(), b.isnan())):
            return f"output {index} differs from eager in {(a != b).sum()} of {a.numel()} elements"
    return None


def _cases_on_rank(ctx, ranges: list[tuple[int, int]]) -> list[list]:
    """Per (first seed, count) of `ranges`: (seed, what is wrong or None) of each case, on this rank."""
    return [[(seed, check_case(random_case(seed), ctx.group.group_name, ctx.rank)) for seed in range(first, first + count)]
            for first, count in ranges]


def _failures_of_ranges(ranges: list[tuple[int, int]], timeout_s: int) -> list[list[str]]:
    """Every case of every range on 2 gloo ranks (one spawn): per range, a report per failing case and rank."""
    failures = [[] for _ in ranges]
    for rank_results in run_on_ranks(_cases_on_rank, 2, ranges, timeout_s=timeout_s):
        for found, range_results in zip(failures, rank_results):
            for seed, problem in range_results:
                if problem is not None:
                    found.append(f"seed {seed}: {problem}\n{random_case(seed)}\n{render(random_case(seed))}")
    return failures


def _failures(first: int, count: int, timeout_s: int) -> list[str]:
    (failures,) = _failures_of_ranges([(first, count)], timeout_s)
    return failures


@pytest.fixture(scope="module")
def failures(request) -> dict[str, list[str]]:
    """{test name: failure reports} of the selected tests' seeds, from one spawn of the ranks (its timeout:
    the sum of theirs)."""
    names = [name for name in SEED_RANGES if selected(request, name)]
    ranges = [SEED_RANGES[name][:2] for name in names]
    return dict(zip(names, _failures_of_ranges(ranges, timeout_s=sum(SEED_RANGES[name][2] for name in names))))


def test_random_fp8_quantizations_fold_exactly_when_they_should_and_equal_eager(failures):
    found = failures["test_random_fp8_quantizations_fold_exactly_when_they_should_and_equal_eager"]
    assert not found, "\n".join(found[:3])


@pytest.mark.slow
def test_more_random_fp8_quantizations(failures):
    found = failures["test_more_random_fp8_quantizations"]
    assert not found, "\n".join(found[:3])


def test_the_draws_cover_every_choice():
    """The generator's draws over the quick and slow seeds include every recipe field and every wrong kind."""
    cases = [random_case(seed) for seed in range(QUICK_CASES + SLOW_CASES)]
    for field, values in (("scaling", {"group", "row", "static_mul", "static_div"}),
                          ("grouping", {"keep_rows", "unflatten", "flat", "padded"}),
                          ("power_of_two", {"none", "ceil", "floor", "round"}),
                          ("apply", {"divide", "reciprocal", "one_over"}),
                          ("clamp", {"none", "both", "min_then_max", "max_then_min", "from_448", "one_side", "240"}),
                          ("wrong_scale", {"none", "per_tensor", "columns"}), ("dynamic", {True, False}),
                          ("scale_in_activation_dtype", {True, False}), ("min_scale", {True, False}),
                          ("power_spelling", {"exp2", "pow_scalar"}), ("bound_after_rounding", {True, False}),
                          ("fp8_max", {"literal", "module_constant"}), ("clamp_spelling", {"clamp", "min_max_tensors"}),
                          ("other_wrong", {"none", "lossy_maximum", "whole_group_pad", "zero_guard"})):
        assert {getattr(case, field) for case in cases} == values, field
    assert any(case.fp8_max == "module_constant" and case.dynamic and case.scaling in ("group", "row") for case in cases)
    assert 0.6 < sum(case.folds for case in cases) / len(cases) < 0.9


if __name__ == "__main__":
    first, count = int(sys.argv[1]), int(sys.argv[2])
    problems = _failures(first, count, timeout_s=max(600, count * 20))
    print("\n".join(problems) or f"{count} cases from seed {first}: no failures")
