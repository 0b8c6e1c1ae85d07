"""Differential test of the passes: seeded random programs around the all-reduce -> residual add ->
RMSNorm chain (tests/differential_cases.py) compiled with the fxfuse backend, against eager, on 2 gloo
ranks.

Each case is compiled with `FxfuseBackend(inner="eager")` and, for a share of the cases, with
`inner="inductor"`, through `OrderCheckedBackend` (no collective moved later or reordered); its outputs
and its inputs after the call (programs mutate some) must equal eager's: float32 within 1e-5, float16
and bfloat16 within 4 rounding steps of the dtype, dtypes and shapes exactly. Cases are compiled
`BATCH` at a time as one program (outputs still checked case by case): fewer compiles, and the passes
see several sites side by side. A failing batch is checked case by case: a failing case is shrunk
(`differential_cases.simpler`) to a smaller one that still fails, and reported with its seed and source;
cases that pass alone but fail together are cut down to the fewest that still do, and reported.
The quick loop runs `QUICK_CASES` seeds, `slow` `SLOW_CASES` more; when both tests are selected, both
sets of seeds run in one spawn of the ranks (`outcomes`). Run other seeds with
`.venv/bin/python tests/test_differential.py FIRST COUNT [INDUCTOR_SHARE]`.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from collective_order import OrderCheckedBackend
from differential_cases import Case, make_inputs, random_case, render, simpler
from selection import selected

from fxfuse.runner.launch import run_on_ranks

QUICK_CASES = 30
SLOW_CASES = 300
#: Each test's seeds, share of cases also compiled with Inductor, and seconds its cases may take.
SEED_SETS = {
    "test_differential_quick": (list(range(QUICK_CASES)), 0.07, 400),
    "test_differential_slow": (list(range(QUICK_CASES, QUICK_CASES + SLOW_CASES)), 0.05, 2400),
}
#: Relative (and, times the largest expected magnitude, absolute) tolerance by a case's activation dtype.
TOLERANCE = {"float32": 1e-5, "float16": 4 * 2.0**-10, "bfloat16": 4 * 2.0**-7}
#: Shrinking compiles at most this many smaller cases.
SHRINK_TRIES = 25
#: Cases compiled together as one program (`together`): besides a compile saved, the passes see sites
#: of several programs side by side (two such mistakes were found this way).
BATCH = 8


def program_of(case: Case):
    """The rendered program of `case`, as a function, and its input descriptions."""
    source, inputs = render(case)
    namespace = {"torch": torch, "funcol": funcol, "dist": dist, "F": F}
    exec(compile(source, f"<case {case.seed}>", "exec"), namespace)  # noqa: S102 - our own generated source
    return namespace["program"], inputs


def together(programs: list, sizes: list[int]):
    """One program running `programs` in turn, each on its `sizes` inputs (taken in order from one
    argument list), returning all their outputs in order."""

    def program(*inputs, g, g2):
        outputs, start = [], 0
        for run, size in zip(programs, sizes):
            outputs.extend(run(*inputs[start:start + size], g=g, g2=g2))
            start += size
        return tuple(outputs)

    return program


def _call(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """fn's outputs on copies of `inputs`, then those copies (after any mutation)."""
    copies = [t.clone() for t in inputs]
    with torch.no_grad():
        outputs = fn(*copies)
    return list(outputs) + copies


def _mismatch(got: list[torch.Tensor], want: list[torch.Tensor], precision: str) -> str | None:
    """How `got` differs from `want` beyond the tolerance of `precision`, or None."""
    if len(got) != len(want):
        return f"{len(got)} outputs, eager gives {len(want)}"
    tolerance = TOLERANCE[precision]
    for index, (a, b) in enumerate(zip(got, want)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"output {index} is {a.dtype} {list(a.shape)}, eager gives {b.dtype} {list(b.shape)}"
        scale = max(1.0, b.double().abs().nan_to_num(0.0).max().item()) if b.numel() else 1.0
        try:
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * scale, equal_nan=True)
        except AssertionError as error:
            return f"output {index}: " + str(error).replace("\n", " ")
    return None


def eager_runs(case: Case, groups, rank: int) -> bool:
    """Whether eager runs `case`'s program (the generator also draws shapes that do not broadcast, ...);
    runs the same collectives on every rank."""
    program, described = program_of(case)
    try:
        _call(functools.partial(program, g=groups[0], g2=groups[1]), make_inputs(described, case.seed, rank))
    except Exception:  # noqa: BLE001 - an invalid drawn program
        return False
    return True


def cases_failure(cases: list[Case], groups, rank: int, fused: Counter | None = None) -> str | None:
    """Why `cases` (programs eager runs, of one dynamic setting and one list of inner compilers), compiled
    as one program (`together`), give something other than eager on this rank, or None. Runs the same
    collectives on every rank."""
    programs, described = zip(*(program_of(case) for case in cases))
    inputs = [make_inputs(items, case.seed, rank) for items, case in zip(described, cases)]
    expected = [_call(functools.partial(program, g=groups[0], g2=groups[1]), case_inputs)
                for program, case_inputs in zip(programs, inputs)]
    output_counts = [len(want) - len(case_inputs) for want, case_inputs in zip(expected, inputs)]
    fn = functools.partial(together(list(programs), [len(case_inputs) for case_inputs in inputs]), g=groups[0], g2=groups[1])
    fused = fused if fused is not None else Counter()
    for inner in cases[0].inners:
        backend = OrderCheckedBackend(inner=inner)
        torch._dynamo.reset()
        try:
            got = _call(torch.compile(fn, backend=backend, fullgraph=True, dynamic=cases[0].dynamic),
                        [t for case_inputs in inputs for t in case_inputs])
        except Exception as error:  # noqa: BLE001 - every compile error is a finding
            return f"{inner} inner: {type(error).__name__}: {str(error)[:3000]}"
        outputs, copies = got[:sum(output_counts)], got[sum(output_counts):]
        for case, want, count, case_inputs in zip(cases, expected, output_counts, inputs):
            mismatch = _mismatch(outputs[:count] + copies[:len(case_inputs)], want, case.dtype)
            if mismatch is not None:
                return f"{inner} inner, case {case.seed}: {mismatch[:3000]}"
            outputs, copies = outputs[count:], copies[len(case_inputs):]
        fused[f"compiled_{inner}"] += len(cases)
        for record in backend.records:
            fused["fused"] += record.stats.fused
            fused["merged"] += record.stats.merged
    return None


def case_failure(case: Case, groups, rank: int) -> str | None:
    """`cases_failure` of `case` alone (None also when eager cannot run it)."""
    return cases_failure([case], groups, rank) if eager_runs(case, groups, rank) else None


def _agreed(flag: bool, group) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _smallest_still_failing(start, message: str | None, smaller, failure_of, group, max_tries: float):
    """Greedy shrinking: take the first of `smaller(current)` that still fails on some rank (`failure_of`
    gives this rank's reason or None), again and again until none does or `max_tries` candidates were
    tried; returns the smallest found and this rank's reason for it (None if it fails on another rank)."""
    current, tries, improved = start, 0, True
    while improved and tries < max_tries:
        improved = False
        for candidate in smaller(current):
            if tries >= max_tries:
                break
            tries += 1
            failure = failure_of(candidate)
            if _agreed(failure is not None, group):
                current, message, improved = candidate, failure, True
                break
    return current, message


def _shrunk(case: Case, groups, rank: int, message: str | None) -> tuple[Case, str | None]:
    """The smallest case found (`differential_cases.simpler`, at most `SHRINK_TRIES` compiles) that still
    fails on some rank (this rank's reason, if it fails here)."""
    return _smallest_still_failing(case, message, simpler, lambda candidate: case_failure(candidate, groups, rank),
                                   groups[0], SHRINK_TRIES)


def report(seed: int, case: Case, message: str | None, rank: int) -> str:
    """A failing case as text: seed, reason, the minimal case and its program's source."""
    source, inputs = render(case)
    shapes = ", ".join(f"{item.name}: {item.dtype}{list(item.shape)}" for item in inputs)
    return (f"seed {seed} (rank {rank}): {message or 'fails on another rank'}\nminimal case: {case}\n"
            f"inputs: {shapes}\n{source}")


def _fewest_failing_together(cases: list[Case], groups, rank: int, message: str | None) -> tuple[list[Case], str | None]:
    """The fewest of `cases` found (one dropped at a time, down to two) that still fail compiled together on
    some rank (this rank's reason, if they fail here); each passes alone."""

    def one_fewer(current: list[Case]) -> list[list[Case]]:
        return [current[:index] + current[index + 1:] for index in range(len(current))] if len(current) > 2 else []

    return _smallest_still_failing(cases, message, one_fewer, lambda fewer: cases_failure(fewer, groups, rank),
                                   groups[0], math.inf)


def batches(cases: list[Case]) -> list[list[Case]]:
    """`cases` in batches of at most `BATCH` compiled together, each of one dynamic setting and one list
    of inner compilers, in seed order within each."""
    kinds: dict[tuple, list[Case]] = {}
    for case in cases:
        kinds.setdefault((case.dynamic, case.inners), []).append(case)
    return [kind[start:start + BATCH] for kind in kinds.values() for start in range(0, len(kind), BATCH)]


def check_cases_on_rank(ctx, seeds: list[int], inductor_share: float) -> tuple[dict[int, tuple[bool, str]], Counter]:
    """Run every seed's case on this rank, `BATCH` at a time compiled together: ({first seed: (failed
    here, report)} of the failing cases and combinations, counts of what was compiled). A failing batch
    is checked case by case (a failing case is shrunk); if every case passes alone, the batch is cut
    down to the fewest cases that still fail together."""
    groups = (ctx.group, dist.new_group(list(range(ctx.world_size))))
    counts: Counter = Counter()
    failures = {}
    valid = []
    for seed in seeds:
        case = random_case(seed, inductor_share)
        counts["cases"] += 1
        if eager_runs(case, groups, ctx.rank):
            valid.append(case)
        else:
            counts["invalid"] += 1
    for batch in batches(valid):
        failure = cases_failure(batch, groups, ctx.rank, counts)
        if not _agreed(failure is not None, groups[0]):
            continue
        alone_failing = False
        for case in batch:
            failure_alone = case_failure(case, groups, ctx.rank)
            if _agreed(failure_alone is not None, groups[0]):
                alone_failing = True
                minimal, message = _shrunk(case, groups, ctx.rank, failure_alone)
                failures[case.seed] = (message is not None, report(case.seed, minimal, message, ctx.rank))
        if not alone_failing:
            fewest, message = _fewest_failing_together(batch, groups, ctx.rank, failure)
            seeds_text = ", ".join(str(case.seed) for case in fewest)
            failures[fewest[0].seed] = (message is not None, f"seeds {seeds_text} pass alone and fail compiled together:\n"
                                        + "\n\n".join(report(case.seed, case, message, ctx.rank) for case in fewest))
    return failures, counts


def check_sets_on_rank(ctx, sets: list[tuple[list[int], float]]) -> list[tuple[dict[int, tuple[bool, str]], Counter]]:
    """`check_cases_on_rank` of each (seeds, inductor share) in turn, on one process group."""
    return [check_cases_on_rank(ctx, seeds, inductor_share) for seeds, inductor_share in sets]


def run_case_sets(sets: list[tuple[list[int], float]], timeout_s: float) -> list[tuple[list[str], Counter]]:
    """Every case of every set on 2 gloo ranks (one spawn), per set: one report per failing seed (from
    the first rank it failed on) and rank 0's counts."""
    results = run_on_ranks(check_sets_on_rank, 2, sets, timeout_s=timeout_s)
    outcomes = []
    for per_rank in zip(*results):
        reports = {}
        for failures, _ in per_rank:
            for seed, (failed_here, text) in failures.items():
                if seed not in reports or failed_here and not reports[seed][0]:
                    reports[seed] = (failed_here, text)
        outcomes.append(([reports[seed][1] for seed in sorted(reports)], per_rank[0][1]))
    return outcomes


def run_cases(seeds: list[int], inductor_share: float, timeout_s: float) -> tuple[list[str], Counter]:
    """`run_case_sets` of one set."""
    (outcome,) = run_case_sets([(seeds, inductor_share)], timeout_s)
    return outcome


@pytest.fixture(scope="module")
def outcomes(request) -> dict[str, tuple[list[str], Counter]]:
    """{test name: (failure reports, counts)} of the selected tests' seed sets, from one spawn of the ranks
    (its timeout: the sum of theirs)."""
    names = [name for name in SEED_SETS if selected(request, name)]
    sets = [SEED_SETS[name][:2] for name in names]
    return dict(zip(names, run_case_sets(sets, timeout_s=sum(SEED_SETS[name][2] for name in names))))


def _assert_all_pass(outcomes: dict, name: str) -> Counter:
    failures, counts = outcomes[name]
    assert not failures, f"{len(failures)} failing case report(s):\n\n" + "\n\n".join(failures)
    assert counts["invalid"] <= len(SEED_SETS[name][0]) // 10, counts  # the generator draws programs eager runs
    return counts


def test_differential_quick(outcomes):
    """30 cases (2 of them also under Inductor): about a minute on 2 busy cores."""
    counts = _assert_all_pass(outcomes, "test_differential_quick")
    assert counts["fused"] > QUICK_CASES // 3 and counts["merged"] > 0 and counts["compiled_inductor"] > 0, counts


@pytest.mark.slow
def test_differential_slow(outcomes):
    counts = _assert_all_pass(outcomes, "test_differential_slow")
    assert counts["fused"] > SLOW_CASES // 3 and counts["compiled_inductor"] > SLOW_CASES // 20, counts


def test_batches_hold_one_dynamic_setting_and_one_list_of_inner_compilers():
    cases = [random_case(seed, 0.07) for seed in range(60)]
    found = batches(cases)
    assert sorted(case.seed for batch in found for case in batch) == list(range(60))
    assert all(len(batch) <= BATCH and len({(case.dynamic, case.inners) for case in batch}) == 1 for batch in found)
    assert len({(batch[0].dynamic, batch[0].inners) for batch in found}) > 2  # the draws give several kinds


def test_together_runs_each_program_on_its_own_inputs_in_turn():
    seen = []

    def first(a, *, g, g2):
        seen.append(("first", g, g2))
        return (a + 1,)

    def second(a, b, *, g, g2):
        seen.append(("second", g, g2))
        return a * b, b - a

    outputs = together([first, second], [1, 2])(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0), g="g", g2="g2")
    assert [float(t) for t in outputs] == [2.0, 6.0, 1.0]
    assert seen == [("first", "g", "g2"), ("second", "g", "g2")]


if __name__ == "__main__":
    first, count = int(sys.argv[1]), int(sys.argv[2])
    found, counted = run_cases(list(range(first, first + count)), float(sys.argv[3]) if len(sys.argv) > 3 else 0.1,
                               timeout_s=6 * 3600)
    print("\n\n".join(found))
    print(f"{len(found)} failing of {count}; {dict(counted)}")
