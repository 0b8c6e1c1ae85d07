"""GPU tests of the fused op at tensor-parallel sizes 2, 4 and 8, every rank on ONE GPU (issue 32).

One spawn per world size (the module-scoped fixture `run`, test ids `ws2`, `ws4`, `ws8`): gloo ranks
share the GPU (NCCL refuses ranks on one device), the fused kernels exchange data through CUDA IPC as
between GPUs, and each rank runs every check below in that one spawn. Per rank, bf16 at hidden 7168,
1, 16 and 128 tokens, against the fp32 reference (`flashinfer_gpu.reference`):
- the TensorRT-LLM kernel, one-shot and two-shot (two-shot from world size + 1 tokens), on fxfuse's
  CUDA-IPC workspace;
- FlashInfer's PCIe IPC all-reduce + the fused norm (FlashInfer >= 0.7.2). Its untuned launch
  configuration depends on the world size and the payload: at 8 ranks a push to every peer below 32
  KiB (1 token is 14 KiB), a staged ring above (its 8-rank schedule); at 4 a staged all-to-all, then
  the ring; at 2 one kernel. The configurations each rank resolved are checked and printed;
- the fallback: the group's all-reduce (gloo here) + the fused norm;
- the FP8 variant (`Fp8Recipe` per_group 128 and per_row) called as the op, on the group whose agreed
  topology picks the TensorRT-LLM kernel and on the one that picks the PCIe path, against
  `quantize_fp8` of the fp32 reference norm: tolerantly, since the kernels quantize their bf16 norm
  (its scales differ by rounding steps, and codes by one e4m3 step where a value sits near a boundary);
- the norm variants (`flashinfer_gpu.NORM_VARIANTS`) through each plan that takes them;
each eagerly and, where a CUDA graph can hold the path, captured and replayed twice on fresh input (the
captured call counted as the fused path's). A gloo all-reduce is host work a graph cannot record, so
the fallback is checked eagerly only (tests/gpu/test_fallback_gpu.py replays it on one NCCL rank).
Then a new group whose TensorRT-LLM workspace creation fails on the last rank (it sees no free GPU
memory): every rank falls back together, with the same reason naming that rank.

How the paths are chosen: FXFUSE_TOPOLOGY=nvswitch makes the world group's op pick the TensorRT-LLM
kernel; a second group of the same ranks gets the agreed config with topology PCIe (`install_config`:
the settings are read once per process), so its op picks the PCIe path; forced plans
(`fxfuse.op.runtime.prepare.forced_plan`) run one implementation each, whatever the table would pick.

What the runs need (expected; to be measured on the H200, where the last test prints the measured
values per world size; DEVELOPERS.md keeps them):
- launch (spawn, torch and fxfuse import, CUDA context, gloo rendezvous): to be measured, expected
  5-10 s at 2 ranks, 10-20 s at 8;
- device memory per rank: the CUDA context (about 0.5 GiB), the allocator (inputs, fp32 references, graph
  pools: under 0.5 GiB) and the workspaces (at 8 ranks and 128 tokens: TensorRT-LLM 58 MiB, PCIe under
  44 MiB): to be measured, expected about 1 GiB; the test asserts under 4 GiB (8 ranks: 32 of 139 GiB);
- host memory per rank: to be measured, expected 1-2 GiB RSS (torch, Triton, FlashInfer's modules);
- time: FlashInfer's kernels are JIT-built in the test process first (`build_flashinfer_kernels`: about
  5 minutes on a fresh machine, as in test_flashinfer_fusion.py's first fixture; seconds once cached);
  the first spawn also builds the C++ fallback (20 s) and the Triton kernels. Then, to be measured,
  expected ws2 15-30 s, ws4 30 s, ws8 60 s (8 processes time-slice the GPU: a fused call completes once
  all 8 were scheduled). Each spawn's timeout is `SPAWN_TIMEOUT_S`, 300 s.

Run exactly these tests on the lent device (carry [".whl072s"]; one call of about 7-9 minutes on a fresh
machine, 5 of them the JIT):
    WHEELS=.whl072s PARTS=tests TESTS=tests/gpu/test_world_sizes_gpu.py TESTS_TIMEOUT_S=540 scripts/gpu_check.sh
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from flashinfer_gpu import (
    EPS,
    FLASHINFER_GPU_MARKS,
    NEEDS_PCIE,
    NORM_VARIANTS,
    DeviceMemoryPeak,
    build_flashinfer_kernels,
    fused_calls,
    inputs,
    reference,
    rel_errs,
    trtllm_takes,
    variant_arguments,
)

from fxfuse.op.decide.flashinfer_version import installed_features
from fxfuse.op.fp8_recipe import Fp8Recipe
from fxfuse.runner.launch import run_on_ranks

pytestmark = FLASHINFER_GPU_MARKS

WORLD_SIZES = (2, 4, 8)
HIDDEN = 7168
TOKENS = (1, 16, 128)
#: Seeds of the eager inputs, the captured call's inputs and the fresh inputs each replay gets.
EAGER_SEED, CAPTURE_SEED, REPLAY_SEEDS = 0, 1, (2, 3)
#: Seconds one spawn may take (FlashInfer's JIT is done before, in this process).
SPAWN_TIMEOUT_S = 300
FP8_RECIPES = {"fp8_per_group": Fp8Recipe("per_group", 128, 1e-12), "fp8_per_row": Fp8Recipe("per_row", 0, 1e-12)}
#: Upper bounds of the metrics (relative L2 errors against the fp32 reference, unless named otherwise).
#: bf16 rounding alone gives about 3e-3 on normed and residual; an emulation of 8 bf16 partial sums (a
#: ring's) gave 4.5e-3 there, FP8 scales 4e-3 (L2) and 1.9e-2 (largest), dequantized 2.7e-2 (e4m3's own).
UPPER_BOUNDS = {"normed": 1e-2, "residual": 1e-2, "scales": 1e-2, "scales_max": 5e-2, "dequantized": 5e-2}
#: Lower bounds: the share of FP8 codes equal to those of the quantized reference (0.90 in that emulation).
LOWER_BOUNDS = {"codes_equal": 0.8}
#: What one call of each path adds to `fused_calls()` ("trtllm": the op where the table picks the
#: TensorRT-LLM kernel: FlashInfer's heuristic takes one-shot up to 128 tokens at these world sizes).
EXPECTED_RAN = {"oneshot": {"oneshot": 1}, "twoshot": {"twoshot": 1}, "trtllm": {"oneshot": 1}, "pcie": {"pcie": 1},
                "fallback": {}}
#: Paths a CUDA graph can hold (a gloo all-reduce is host work).
CAPTURABLE = {"oneshot", "twoshot", "trtllm", "pcie"}
#: Device memory one rank may use (its CUDA context, allocator and workspaces).
MAX_DEVICE_BYTES_PER_RANK = 4 << 30


@dataclass(frozen=True)
class Case:
    """One implementation on one input shape: `run(x, residual, weight)` returns its outputs (what the test
    captures in a CUDA graph), `metrics(outputs, xs, residual, weight)` their distances to the fp32
    reference of the inputs (`xs`: every rank's x)."""

    run: Callable
    metrics: Callable


def plain_metrics(out, expected) -> dict:
    """Relative L2 errors of (normed, residual_out) against the reference's."""
    return dict(zip(("normed", "residual"), rel_errs(out, expected)))


def fp8_metrics(out, expected, recipe: Fp8Recipe) -> dict:
    """The FP8 op's outputs (quantized, scales, residual_out, normed) against `quantize_fp8` of the fp32
    reference norm: its normed and residual errors, the scales' relative L2 error and largest relative
    difference, the share of codes equal, and the dequantized values' error against the fp32 norm."""
    from fxfuse.models.quant.reference import dequantize_activations
    from fxfuse.op.fp8_recipe import quantize_fp8

    quantized, scales, residual_out, normed = out
    expected_normed, expected_residual = expected
    expected_q, expected_scales = quantize_fp8(expected_normed, recipe)
    group = recipe.group_size if recipe.scaling == "per_group" else expected_normed.shape[-1]
    dequantized = dequantize_activations(quantized, scales, group)
    return {**plain_metrics((normed, residual_out), expected),
            "scales": ((scales - expected_scales).norm() / expected_scales.norm()).item(),
            "scales_max": ((scales - expected_scales).abs() / expected_scales).max().item(),
            "codes_equal": (quantized.view(torch.uint8) == expected_q.view(torch.uint8)).float().mean().item(),
            "dequantized": ((dequantized - expected_normed).norm() / expected_normed.norm()).item()}


def plain_case(plan) -> Case:
    """A plan (`forced_plan`) on the plain norm."""
    return Case(lambda x, residual, weight: plan(x, residual, weight, EPS, False),
                lambda out, xs, residual, weight: plain_metrics(out, reference(xs, residual, weight)))


def fp8_case(group_name: str, recipe: Fp8Recipe) -> Case:
    """The FP8 op on `group_name`, its normed output returned too."""
    from fxfuse.op.fp8_schema import FP8_OPS, recipe_arguments

    def run(x, residual, weight):
        return FP8_OPS[0](x, residual, weight, EPS, group_name, static_scale=None, return_normed=True,
                          **recipe_arguments(recipe))

    return Case(run, lambda out, xs, residual, weight: fp8_metrics(out, reference(xs, residual, weight), recipe))


def variant_case(plan, variant: str) -> Case:
    """A plan on a norm variant, the weight zero-centred as Gemma stores it; the metrics also say whether
    the outputs have the activations' and the residual's dtypes."""
    def arguments(residual, weight):
        return variant_arguments(variant, residual, weight - 1)

    def run(x, residual, weight):
        res, w, norm = arguments(residual, weight)
        return plan(x, res, w, EPS, False, norm)

    def metrics(out, xs, residual, weight):
        res, w, norm = arguments(residual, weight)
        dtypes = out[0].dtype == torch.bfloat16 and out[1].dtype == res.dtype
        return {**plain_metrics(out, reference(xs, res, w, norm[0])), "dtypes": dtypes}

    return Case(run, metrics)


def pcie_topology_group(ctx):
    """A second group of the same ranks whose agreed config says PCIe (what FXFUSE_TOPOLOGY=pcie would
    give; the settings are read once per process and the world group keeps NVSwitch)."""
    from fxfuse.op.decide.group_config import config_of, install_config
    from fxfuse.op.decide.topology import Topology

    group = dist.new_group(list(range(ctx.world_size)))
    install_config(group, replace(config_of(group), topology=Topology.PCIE, topology_reason="the test's PCIe group"))
    return group


def cases(ctx, pcie_group, features):
    """((path, variant, tokens), Case) for every check of this rank, in the same order on every rank."""
    from fxfuse.op.decide.modes import FusionMode
    from fxfuse.op.runtime.prepare import forced_plan

    def plan(mode, group):
        return forced_plan(group, mode, HIDDEN, torch.bfloat16, max(TOKENS))

    plans = {"oneshot": plan(FusionMode.ONESHOT, ctx.group), "twoshot": plan(FusionMode.TWOSHOT, ctx.group),
             "fallback": plan(FusionMode.FALLBACK, ctx.group)}
    op_groups = {"trtllm": ctx.group.group_name}
    if pcie_group is not None:
        plans["pcie"] = plan(FusionMode.PCIE, pcie_group)
        op_groups["pcie"] = pcie_group.group_name
    for tokens in TOKENS:
        for path, path_plan in plans.items():
            if not (path == "twoshot" and tokens <= ctx.world_size):  # two-shot splits the tokens over the ranks
                yield (path, "plain", tokens), plain_case(path_plan)
        for path, group_name in op_groups.items():
            for name, recipe in FP8_RECIPES.items():
                yield (path, name, tokens), fp8_case(group_name, recipe)
        for variant in NORM_VARIANTS:
            for path in ("fallback", "pcie", "oneshot"):
                if path in plans and (path != "oneshot" or trtllm_takes(variant, features)):
                    yield (path, variant, tokens), variant_case(plans[path], variant)


def run_case(ctx, path: str, case: Case, tokens: int, device) -> dict:
    """One case eagerly and, if its path is capturable, captured once and replayed on fresh inputs: the
    calls counted for the eager and the captured call, and the metrics of each output."""
    x, xs, residual, weight = inputs(ctx.rank, ctx.world_size, tokens, EAGER_SEED, device, HIDDEN)
    result = {}
    result["ran"], out = counted(case.run, x, residual, weight)
    result["eager"] = case.metrics(out, xs, residual, weight)
    if path not in CAPTURABLE:
        return result
    x, _, residual, weight = inputs(ctx.rank, ctx.world_size, tokens, CAPTURE_SEED, device, HIDDEN)
    case.run(x, residual, weight)  # first outside capture, as a caller must
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result["captured_ran"], captured = counted(case.run, x, residual, weight)
    result["replays"] = []
    for seed in REPLAY_SEEDS:
        fresh_x, fresh_xs, fresh_residual, _ = inputs(ctx.rank, ctx.world_size, tokens, seed, device, HIDDEN)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        graph.replay()
        torch.cuda.synchronize()
        result["replays"].append(case.metrics(captured, fresh_xs, fresh_residual, weight))
    del graph, captured
    return result


def counted(call, *args):
    """({mode: fused calls} that `call(*args)` issued, its result)."""
    before = fused_calls()
    out = call(*args)
    after = fused_calls()
    return {mode: n - before.get(mode, 0) for mode, n in after.items() if n != before.get(mode, 0)}, out


def launch_config(workspace, tokens: int) -> tuple | None:
    """(variant, blocks, threads) of the PCIe all-reduce's launch configuration for `tokens` tokens."""
    config = workspace.handle.configs[tokens]
    return None if config is None else (config.variant.name, config.blocks, config.threads)


def creation_failing_on_the_last_rank(ctx, device) -> dict:
    """A new group's TensorRT-LLM workspace, whose creation fails on the last rank (it sees no free GPU
    memory): whether it was made, the agreed reason, then one op call on the group, its errors and
    what it ran."""
    import fxfuse
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.plans import fusion_stats
    from fxfuse.op.runtime.workspace import TRTLLM
    from fxfuse.op.schema import allreduce_residual_rmsnorm

    group = dist.new_group(list(range(ctx.world_size)))
    free_memory = torch.cuda.mem_get_info
    if ctx.rank == ctx.world_size - 1:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.mem_get_info = lambda *a: (0, total)
    try:
        ready = fxfuse.prepare(group, HIDDEN, torch.bfloat16, max_tokens=16)
    finally:
        torch.cuda.mem_get_info = free_memory
    x, xs, residual, weight = inputs(ctx.rank, ctx.world_size, 16, 7, device, HIDDEN)
    before = fusion_stats()
    out = allreduce_residual_rmsnorm(x, residual, weight, EPS, group.group_name)
    after = fusion_stats()
    return {"ready": ready, "failure": TRTLLM.failure(group.group_name, HIDDEN, torch.bfloat16),
            "errors": rel_errs(out, reference(xs, residual, weight)),
            "fused": {key: n for key, n in after["fused"].items() if key[0] == group.group_name},
            "fallback_calls": sum(after["fallback"].values()) - sum(before["fallback"].values())}


def world_size_checks(ctx) -> dict:
    """On each rank: the workspaces, every case of `cases` (eager, then replayed where capturable), the
    creation failing on the last rank, and the time and memory it took."""
    entered = time.time()
    os.environ.update(FXFUSE_TOPOLOGY="nvswitch", FXFUSE_PCIE_PROFILE="rootcplx")
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    import fxfuse
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.workspace import PCIE, TRTLLM

    device, bf16 = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    features = installed_features()
    report: dict = {"entered": entered, "pcie": None}
    started = time.monotonic()
    report["ready"] = fxfuse.prepare(ctx.group, HIDDEN, bf16, max_tokens=max(TOKENS))
    report["failure"] = TRTLLM.failure(ctx.group.group_name, HIDDEN, bf16)
    pcie_group = pcie_topology_group(ctx) if features.pcie else None
    if pcie_group is not None:
        ready = fxfuse.prepare(pcie_group, HIDDEN, bf16, max_tokens=max(TOKENS))
        workspace = PCIE.lookup(pcie_group.group_name, HIDDEN, bf16)
        report["pcie"] = {"ready": ready, "failure": PCIE.failure(pcie_group.group_name, HIDDEN, bf16),
                          "schedule": {t: launch_config(workspace, t) for t in TOKENS} if workspace else {}}
    report["prepare_s"] = time.monotonic() - started
    if not report["ready"] or (pcie_group is not None and not report["pcie"]["ready"]):
        return report  # agreed on every rank; the first test says why

    started = time.monotonic()
    report["checks"] = {key: run_case(ctx, key[0], case, key[2], device) for key, case in cases(ctx, pcie_group, features)}
    report["checks_s"] = time.monotonic() - started
    report["creation_failure"] = creation_failing_on_the_last_rank(ctx, device)
    report["memory"] = {"allocator_peak": torch.cuda.max_memory_reserved(),
                        "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for group in (ctx.group, pcie_group):
        if group is not None:
            fxfuse.destroy_workspaces(group, graphs_released=True)
    return report


@dataclass
class WorldSizeRun:
    """One spawn's outcome: every rank's report, when it started (wall clock), how long it took, and the
    most GPU memory its ranks held together."""

    world_size: int
    ranks: list
    started: float
    wall_s: float
    device_bytes: int


@pytest.fixture(scope="module")
def jit_s() -> float:
    """Seconds FlashInfer's kernels took to build (or load from the cache) in this process, before any spawn."""
    return build_flashinfer_kernels()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world_size: f"ws{world_size}")
def run(request, jit_s) -> WorldSizeRun:
    """One spawn of `request.param` gloo ranks sharing the GPU, every check in it."""
    with DeviceMemoryPeak() as memory:
        started = time.time()
        ranks = run_on_ranks(world_size_checks, request.param, timeout_s=SPAWN_TIMEOUT_S)
    return WorldSizeRun(request.param, ranks, started, time.time() - started, memory.peak - memory.before)


def out_of_bounds(metrics: dict) -> dict:
    """The metrics outside `UPPER_BOUNDS` / `LOWER_BOUNDS`, and the checks that failed (False); empty if none."""
    return {name: value for name, value in metrics.items()
            if value is False or (name in UPPER_BOUNDS and not value < UPPER_BOUNDS[name])
            or (name in LOWER_BOUNDS and not value > LOWER_BOUNDS[name])}


def expected_keys(world_size: int, paths, variants) -> set:
    """The (path, variant, tokens) cases `cases` makes for these paths and variants."""
    return {(path, variant, tokens) for path in paths for variant in variants for tokens in TOKENS
            if not (path == "twoshot" and tokens <= world_size)}


def assert_cases(run: WorldSizeRun, keys: set) -> None:
    """Every rank ran each of `keys`' cases on its path, eagerly and replayed where capturable, within bounds."""
    assert keys, "no case selected"
    for rank, report in enumerate(run.ranks):
        assert report["ready"], f"rank {rank}: no TensorRT-LLM workspace: {report['failure']}"
        assert keys <= set(report["checks"]), sorted(keys - set(report["checks"]))
        for key in sorted(keys, key=repr):
            path, result = key[0], report["checks"][key]
            assert result["ran"] == EXPECTED_RAN[path], (rank, key, result["ran"])
            assert not out_of_bounds(result["eager"]), (rank, key, "eager", result["eager"])
            if path in CAPTURABLE:
                assert result["captured_ran"] == EXPECTED_RAN[path], (rank, key, result["captured_ran"])
                assert len(result["replays"]) == len(REPLAY_SEEDS)
                for metrics in result["replays"]:
                    assert not out_of_bounds(metrics), (rank, key, "replayed", metrics)


def pcie_paths(run: WorldSizeRun) -> tuple:
    """("pcie",) where this FlashInfer has the PCIe all-reduce, else ()."""
    return ("pcie",) if run.ranks[0]["pcie"] is not None else ()


def test_workspaces_are_ready(run):
    for rank, report in enumerate(run.ranks):
        assert report["ready"], f"rank {rank}: TensorRT-LLM workspace not created: {report['failure']}"
        if report["pcie"] is not None:
            assert report["pcie"]["ready"], f"rank {rank}: PCIe workspace not created: {report['pcie']['failure']}"


def test_trtllm_oneshot_and_twoshot_match_the_fp32_reference_eager_and_replayed(run):
    assert_cases(run, expected_keys(run.world_size, ("oneshot", "twoshot"), ("plain",)))


@NEEDS_PCIE
def test_pcie_allreduce_matches_the_fp32_reference_eager_and_replayed(run):
    assert_cases(run, expected_keys(run.world_size, ("pcie",), ("plain",)))


@NEEDS_PCIE
def test_pcie_allreduce_resolves_its_world_size_schedule(run):
    """Every rank resolved the same launch configuration for every token count; from 4 ranks, FlashInfer's
    untuned one for 1 token (14 KiB: a push to every peer at 8 ranks, a staged all-to-all at 4) is
    another kernel than for 128 (a staged ring), so both of the world size's schedules ran."""
    schedules = [report["pcie"]["schedule"] for report in run.ranks]
    assert all(schedule == schedules[0] for schedule in schedules), schedules
    assert set(schedules[0]) == set(TOKENS) and None not in schedules[0].values(), schedules[0]
    if run.world_size > 2:
        assert schedules[0][min(TOKENS)][0] != schedules[0][max(TOKENS)][0], (
            f"one kernel for 1 and {max(TOKENS)} tokens: {schedules[0]} (a PCIe tuning file in use?)")


def test_gloo_fallback_matches_the_fp32_reference(run):
    assert_cases(run, expected_keys(run.world_size, ("fallback",), ("plain",)))


def test_fp8_variant_quantizes_close_to_the_fp32_reference_eager_and_replayed(run):
    assert_cases(run, expected_keys(run.world_size, ("trtllm",) + pcie_paths(run), FP8_RECIPES))


def test_norm_variants_match_the_fp32_reference_on_every_plan_eager_and_replayed(run):
    features = installed_features()
    keys = set()
    for variant in NORM_VARIANTS:
        paths = ("fallback",) + pcie_paths(run) + (("oneshot",) if trtllm_takes(variant, features) else ())
        keys |= expected_keys(run.world_size, paths, (variant,))
    assert_cases(run, keys)


def test_creation_failing_on_the_last_rank_falls_back_on_every_rank(run):
    assert all(report["ready"] for report in run.ranks), "no checks ran (see test_workspaces_are_ready)"
    outcomes = [report["creation_failure"] for report in run.ranks]
    last = run.world_size - 1
    for outcome in outcomes:
        assert outcome["ready"] is False and outcome["failure"], outcome
        assert outcome["fused"] == {} and outcome["fallback_calls"] == 1, outcome
        assert max(outcome["errors"]) < UPPER_BOUNDS["normed"], outcome["errors"]
    # every rank records the same reason, naming the rank and the step that failed
    assert len({outcome["failure"] for outcome in outcomes}) == 1, [outcome["failure"] for outcome in outcomes]
    assert f"rank {last}, checking free GPU memory" in outcomes[0]["failure"] and "MiB free" in outcomes[0]["failure"]


def test_time_and_memory_per_rank(run, jit_s, capsys):
    """Prints what the spawn took (the numbers DEVELOPERS.md keeps) and bounds the device memory per rank."""
    ranks = run.ranks
    assert all(report["ready"] for report in ranks), "no checks ran (see test_workspaces_are_ready)"
    launch_s = max(report["entered"] for report in ranks) - run.started
    device_per_rank = run.device_bytes / run.world_size
    allocator = max(report["memory"]["allocator_peak"] for report in ranks)
    rss = max(report["memory"]["host_peak_rss"] for report in ranks)
    schedule = ranks[0]["pcie"]["schedule"] if ranks[0]["pcie"] is not None else "no PCIe all-reduce"
    with capsys.disabled():
        print(f"\n[ws{run.world_size}] FlashInfer kernels built or loaded before the spawns in {jit_s:.0f} s; "
              f"spawn {run.wall_s:.1f} s: launch (spawn, imports, CUDA, gloo) {launch_s:.1f} s, "
              f"prepare {max(r['prepare_s'] for r in ranks):.1f} s, checks {max(r['checks_s'] for r in ranks):.1f} s; "
              f"per rank: GPU {device_per_rank / 2**30:.2f} GiB (allocator peak {allocator / 2**30:.2f} GiB), "
              f"host RSS {rss / 2**30:.2f} GiB; PCIe launch configurations by tokens: {schedule}")
    assert device_per_rank < MAX_DEVICE_BYTES_PER_RANK, f"{device_per_rank / 2**30:.2f} GiB per rank"
