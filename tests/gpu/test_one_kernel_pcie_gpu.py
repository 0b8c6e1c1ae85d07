"""GPU tests of the one-kernel PCIe path: all-reduce + residual add + RMSNorm (+ FP8) in one Triton launch over
peer-mapped buffers (`fxfuse.op.kernels.one_shot_all_reduce_norm`), at world sizes 2, 4 and 8 on one GPU.

Two harnesses, each in a spawned process with a timeout (a protocol bug hangs a GPU kernel, never the suite):
- ranks as streams of one process (`one_kernel_ranks.StreamRanks`), one process per world size, the three at
  once (`stream_reports`): every norm variant and FP8 recipe,
  bfloat16 and float16, hidden 16 to 8192, 1-16 tokens one by one and up to the workspace's 256, small
  integers and normal values, equal bit for bit to the two-kernel path (`two_kernel_answer`) on every rank;
  CUDA graphs of mixed calls replayed to more than 100,000 calls per world size, then checked on fresh
  inputs; the generation counter after them; a wider draft model's workspace interleaved with the target's;
- ranks as processes sharing the GPU (gloo): the workspace over CUDA IPC (`OneKernelPcieKernels`), eager
  calls and CUDA-graph replays on fresh inputs equal to the two-kernel path, also as it really runs with
  FlashInfer's PCIe all-reduce (FlashInfer >= 0.7.2), on small integers: the exact sum NCCL gives too (NCCL
  refuses two ranks on one GPU); a rank whose workspace creation fails raising the same error on every rank;
  the tuner's side-by-side timing (`compare_pcie_paths`) running and its thresholds entry written.
Ranks sharing one GPU prove correctness, never speed. Run with `pytest -m gpu tests/gpu`; on the lent device, in one
call (carry [".whl072s"] with bench/results moved out of the tree for the call: the 64 MiB limit), 147 s of pytest
on a fresh H100 (2026-12-06; of that, 60 s the stream-rank spawn, its Triton compiles of about 100 kernel variants
included, those of the three world sizes in parallel; FlashInfer's PCIe JIT included):
    WHEELS=.whl072s PARTS=tests TESTS="tests/gpu/test_one_kernel_pcie_gpu.py -x -s" TESTS_TIMEOUT_S=560 scripts/gpu_check.sh
then the compiled model with the path forced: TESTS="tests/gpu/test_compiled_model_cuda_graph.py -k pcie_one_kernel" and
TESTS="tests/gpu/test_compiled_model_tp8_gpu.py -k pcie_one_kernel" (neither needs FlashInfer's TensorRT-LLM JIT,
so both may follow this file in the same call, with `-k one_kernel` and no `-x`, if its time allows).
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from flashinfer_gpu import CUDA_GPU_MARKS, NEEDS_PCIE
from one_kernel_ranks import (
    NORMS,
    StreamRanks,
    norm_arguments,
    one_kernel_call,
    outputs_like,
    rank_inputs,
    same_values,
    two_kernel_answer,
)
from test_fp8_epilogue_gpu import (
    RECIPES,
    _as_float32,
    _limits,
    _recipe_for,
    _static_scale,
)

from fxfuse.op.fp8_recipe import Fp8Limits
from fxfuse.runner.launch import run_on_ranks

pytestmark = CUDA_GPU_MARKS

WORLD_SIZES = (2, 4, 8)
CAPACITY = 256
#: 1-16 tokens one by one (speculative verify: where one-shot kernels with early completion gave NaN), then more.
TOKENS = tuple(range(1, 17)) + (31, 64, 255, 256)
#: Calls per captured graph and replays: more than 100,000 calls per world size.
GRAPH_CALLS, REPLAYS = 50, 2020
#: Seconds a spawn may take (compiles included; the stream ranks' spawn compiles about 100 kernel variants).
SPAWN_TIMEOUT_S = 420


def _mismatches(got: dict, expected: dict, what) -> list:
    return [(what, name) for name in expected if not same_values(got[name], expected[name])]


def stream_ranks_exactness(ctx, world_size: int) -> dict:
    """Every epilogue against the two-kernel path on `world_size` stream ranks: {"calls": n, "mismatches": [...]}."""
    torch.cuda.set_device(0)
    calls, mismatches = 0, []
    cases = [(torch.bfloat16, 7168, norm, None) for norm in NORMS]
    cases += [(torch.bfloat16, hidden, norm, None) for hidden in (4096, 8192) for norm in ("plain", "fp32_residual_gemma")]
    cases += [(torch.bfloat16, hidden, norm, None) for hidden in (16, 8) for norm in ("plain", "no_residual")]  # < a pack per rank
    cases += [(torch.float16, 7168, norm, None) for norm in ("plain", "gemma", "fp32_residual")]
    cases += [(torch.bfloat16, 7168, "plain", name) for name in RECIPES]
    cases += [(torch.float16, 7168, "plain", name) for name in ("per_group", "per_row", "static_div", "per_row_bf16_scale")]
    cases += [(torch.bfloat16, 7000, "plain", name) for name in ("per_group", "per_row")]  # a partial last group
    for dtype, hidden, norm, recipe_name in cases:
        ranks = StreamRanks(world_size, CAPACITY, hidden)
        recipe = None if recipe_name is None else _recipe_for(recipe_name, dtype)
        limits = _as_float32(_limits(recipe_name)) if recipe_name else Fp8Limits()
        static_scale = None if recipe is None else _static_scale(recipe, "cuda")
        tokens_list = TOKENS if recipe is None and hidden in (7168, 16) else (1, 3, 16, 64, 256)
        for tokens in tokens_list:
            for small_integers in (True, False):
                xs, residual, weight = rank_inputs(world_size, tokens, hidden, dtype, tokens, small_integers)
                if tokens == 3 and hidden == 7168 and norm == "plain":  # NaN inputs, the sentinel's own bits among them
                    xs[0].view(torch.int16)[1, 5] = -1
                    xs[-1][2, 9] = float("nan")
                residual, weight, offset, in_fp32 = norm_arguments(norm, residual, weight)
                expected = two_kernel_answer(xs, residual, weight, offset, in_fp32, recipe, static_scale, limits)
                outs = [outputs_like(xs[0], residual, recipe) for _ in range(world_size)]
                ranks.launch(lambda r, peers, programs: one_kernel_call(peers, xs[r], residual, weight, offset, in_fp32,
                                                                        outs[r], programs, recipe, static_scale, limits))
                torch.cuda.synchronize()
                calls += 1
                for rank, out in enumerate(outs):
                    mismatches += _mismatches(out, expected, (str(dtype), hidden, norm, recipe_name, tokens, small_integers, rank))
        if hidden == 7168 and recipe is None and norm == "plain":  # the all-reduce-only epilogue
            from fxfuse.op.kernels.one_shot_all_reduce_norm import (
                Epilogue,
                all_reduce_norm_into,
            )

            for tokens in TOKENS:
                xs, _, _ = rank_inputs(world_size, tokens, hidden, dtype, 7, True)
                sums = [torch.full_like(xs[0], float("nan")) for _ in range(world_size)]
                ranks.launch(lambda r, peers, programs: all_reduce_norm_into(peers, xs[r], Epilogue.ALL_REDUCE, normed=sums[r],
                                                                             programs=programs))
                torch.cuda.synchronize()
                calls += 1
                exact = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
                mismatches += [("all_reduce", tokens, r) for r in range(world_size) if not torch.equal(sums[r], exact)]
    return {"calls": calls, "mismatches": mismatches[:20], "mismatch_count": len(mismatches)}


def stream_ranks_graphs(ctx, world_size: int) -> dict:
    """GRAPH_CALLS mixed calls captured per rank and replayed REPLAYS times, then fresh inputs checked."""
    torch.cuda.set_device(0)
    target, draft = StreamRanks(world_size, 64, 7168), StreamRanks(world_size, 16, 8192)  # a wider draft model
    recipe = _recipe_for("per_group", torch.bfloat16)
    plan = []  # (ranks, tokens, recipe or None)
    for i in range(GRAPH_CALLS):
        tokens = (1, 2, 3, 4, 8, 13, 16, 31, 64)[i % 9]
        plan.append((draft, min(tokens, 16), None) if i % 5 == 4 else (target, tokens, recipe if i % 3 == 0 else None))
    inputs = []
    for i, (ranks, tokens, call_recipe) in enumerate(plan):
        xs, residual, weight = rank_inputs(world_size, tokens, ranks.hidden, torch.bfloat16, i, True)
        inputs.append((xs, residual, weight, [outputs_like(xs[0], residual, call_recipe) for _ in range(world_size)]))

    def calls_of(rank: int, programs: int):
        for (ranks, tokens, call_recipe), (xs, residual, weight, outs) in zip(plan, inputs):
            one_kernel_call(ranks.peers[rank], xs[rank], residual, weight, 0.0, False, outs[rank], programs, call_recipe)

    # warm-up (compiles) on every rank's stream, then one graph per rank
    target.launch(lambda r, peers, programs: calls_of(r, programs))
    torch.cuda.synchronize()
    graphs = []
    for rank in range(world_size):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=target.streams[rank]):
            calls_of(rank, target.programs)
        graphs.append(graph)

    def replay(times: int) -> None:
        current = torch.cuda.current_stream()
        for stream in target.streams:
            stream.wait_stream(current)
        for _ in range(times):
            for rank, graph in enumerate(graphs):
                with torch.cuda.stream(target.streams[rank]):
                    graph.replay()
        for stream in target.streams:
            current.wait_stream(stream)

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    replay(REPLAYS - 1)
    end.record()
    torch.cuda.synchronize()
    for i, (xs, residual, weight, outs) in enumerate(inputs):  # fresh inputs, then the last replay
        for x in xs:
            x.copy_(torch.randint_like(x, -3, 4))
        residual.copy_(torch.randint_like(residual, -3, 4))
    replay(1)
    torch.cuda.synchronize()
    mismatches = []
    for i, ((ranks, tokens, call_recipe), (xs, residual, weight, outs)) in enumerate(zip(plan, inputs)):
        expected = two_kernel_answer(xs, residual, weight, 0.0, False, call_recipe)
        for rank in range(world_size):
            mismatches += _mismatches(outs[rank], expected, (i, tokens, rank))
    per_workspace = {"target": sum(1 for p in plan if p[0] is target), "draft": sum(1 for p in plan if p[0] is draft)}
    total_calls = GRAPH_CALLS * (REPLAYS + 1)  # the warm-up, then the replays
    return {"calls": total_calls, "replay_ms": start.elapsed_time(end), "mismatches": mismatches[:20],
            "mismatch_count": len(mismatches),
            "generations": {"target": target.generations(), "draft": draft.generations()},
            "expected_generations": {name: n * (REPLAYS + 1) % 3 for name, n in per_workspace.items()},
            "too_many_rows": _too_many_rows(target)}


def _too_many_rows(ranks: StreamRanks) -> str:
    """The error of a call with more rows than the workspace holds (raised before any launch)."""
    x = torch.zeros(ranks.capacity + 1, ranks.hidden, dtype=torch.bfloat16, device="cuda")
    try:
        one_kernel_call(ranks.peers[0], x, None, torch.ones(ranks.hidden, dtype=x.dtype, device="cuda"), 0.0, False,
                        outputs_like(x, None), ranks.programs)
    except ValueError as error:
        return str(error)
    return "no error"


def ipc_ranks(ctx, fail_rank: int | None) -> dict:
    """Ranks as processes sharing GPU 0: the IPC workspace, eager calls and graph replays against the two-kernel path."""
    torch.cuda.set_device(0)
    from fxfuse.op.runtime import cuda_ipc
    from fxfuse.op.runtime.one_kernel_pcie import OneKernelPcieKernels

    kernels = OneKernelPcieKernels()
    if fail_rank is not None:
        if ctx.rank == fail_rank:
            runtime = cuda_ipc.cuda_runtime()

            def failing_malloc(size):
                raise RuntimeError(f"cudaMalloc({size}) failed: CUDA error 2 (out of memory)")

            runtime.malloc = failing_malloc
        try:
            kernels.create_workspace(ctx.group, 16, 7168)
        except cuda_ipc.SharedBufferError as error:
            return {"error": str(error)}
        return {"error": None}
    workspace = kernels.create_workspace(ctx.group, 64, 7168)
    mismatches, calls = [], 0
    for tokens in (1, 2, 3, 5, 8, 13, 16, 64, 7, 1):
        for name in ("plain", "fp32_residual_gemma"):
            xs, residual, weight = rank_inputs(ctx.world_size, tokens, 7168, torch.bfloat16, calls, True)
            residual, weight, offset, in_fp32 = norm_arguments(name, residual, weight)
            out = outputs_like(xs[0], residual)
            kernels.run(workspace, xs[ctx.rank], _epilogue(False), residual=residual, weight=weight, eps=1e-6,
                        residual_out=out["residual_out"], normed=out["normed"], weight_offset=offset, weight_in_fp32=in_fp32)
            torch.cuda.synchronize()
            calls += 1
            mismatches += _mismatches(out, two_kernel_answer(xs, residual, weight, offset, in_fp32), ("eager", tokens, name))
    recipe = _recipe_for("per_group", torch.bfloat16)
    xs, residual, weight = rank_inputs(ctx.world_size, 16, 7168, torch.bfloat16, 99, True)
    out = outputs_like(xs[0], residual, recipe)
    x = xs[ctx.rank]

    def call():
        from fxfuse.op.kernels.one_shot_all_reduce_norm import Fp8Outputs

        kernels.run(workspace, x, _epilogue(True), residual=residual, weight=weight, eps=1e-6,
                    residual_out=out["residual_out"], normed=out["normed"],
                    fp8=Fp8Outputs(recipe, None, out["quantized"], out["scales"]))

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    for replay in range(20):
        fresh = rank_inputs(ctx.world_size, 16, 7168, torch.bfloat16, 1000 + replay, True)
        for mine, new in zip(xs, fresh[0]):
            mine.copy_(new)
        residual.copy_(fresh[1])
        graph.replay()
        torch.cuda.synchronize()
        mismatches += _mismatches(out, two_kernel_answer(xs, residual, weight, 0.0, False, recipe), ("graph", replay))
    calls += 1 + 200
    generation = int(workspace.peers.flags[0])
    flashinfer = _against_flashinfer(ctx, kernels, workspace) if _has_pcie() else None
    del graph
    kernels.destroy_workspace(workspace, ctx.group)
    return {"calls": calls, "mismatches": mismatches[:10], "mismatch_count": len(mismatches), "generation": generation,
            "flashinfer": flashinfer}


def _has_pcie() -> bool:
    from fxfuse.op.decide.flashinfer_version import installed_features

    return installed_features().pcie


def _against_flashinfer(ctx, kernels, workspace) -> list:
    """The one kernel against the two-kernel path as it runs (FlashInfer's PCIe all-reduce, then fxfuse's norm
    kernel) on small integers, 1-64 tokens: the mismatches (none expected)."""
    from fxfuse.op.runtime.pcie_kernels import PcieAllReduceKernels

    pcie = PcieAllReduceKernels()
    two = pcie.create_workspace(ctx.group, 64, 7168, torch.bfloat16, "rootcplx", None)
    mismatches = []
    try:
        for tokens in (1, 2, 3, 8, 16, 64):
            xs, residual, weight = rank_inputs(ctx.world_size, tokens, 7168, torch.bfloat16, 500 + tokens, True)
            reduced = torch.empty_like(xs[0])
            pcie.all_reduce(two, xs[ctx.rank], reduced)
            expected = outputs_like(reduced, residual)
            from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into

            add_rmsnorm_into(reduced, residual, weight, 1e-6, expected["residual_out"], expected["normed"])
            out = outputs_like(reduced, residual)
            kernels.run(workspace, xs[ctx.rank], _epilogue(False), residual=residual, weight=weight, eps=1e-6,
                        residual_out=out["residual_out"], normed=out["normed"])
            torch.cuda.synchronize()
            exact = torch.stack([x.double() for x in xs]).sum(0).to(torch.bfloat16)
            mismatches += [("flashinfer sum", tokens)] if not torch.equal(reduced, exact) else []
            mismatches += _mismatches(out, expected, ("flashinfer", tokens))
    finally:
        torch.cuda.synchronize()
        pcie.destroy_workspace(two, ctx.group)
    return mismatches


def tuner_comparison(ctx, path: str) -> dict:
    """`compare_pcie_paths` on ranks sharing the GPU (times meaningless), then its thresholds entry written."""
    torch.cuda.set_device(0)
    from fxfuse.bench.compare_pcie_paths import compare_pcie_paths
    from fxfuse.bench.tune_pcie import describe_ranges, write_thresholds

    timings = compare_pcie_paths(ctx.group, 4096, torch.bfloat16, 16, "rootcplx", None)
    entry = write_thresholds(path, torch.cuda.get_device_name(), ctx.world_size, 4096, "bfloat16", timings) if ctx.rank == 0 else None
    return {"timings": timings, "ranges": entry and describe_ranges(entry)}


def _epilogue(fp8: bool):
    from fxfuse.op.kernels.one_shot_all_reduce_norm import Epilogue

    return Epilogue.FP8 if fp8 else Epilogue.NORM


def _spawn(fn, world_size: int, *args):
    # CUDA_DEVICE_MAX_CONNECTIONS: stream ranks need a hardware queue each; on the default 8 queues two ranks'
    # streams could share one, and the kernel of the rank queued second would wait behind the first's wait for it
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                      CUDA_DEVICE_MAX_CONNECTIONS="32")
    return run_on_ranks(fn, world_size, *args, device="cpu", timeout_s=SPAWN_TIMEOUT_S)


def stream_ranks_reports(ctx) -> dict:
    """Both stream-rank harnesses at world size WORLD_SIZES[ctx.rank]: the spawn's processes are independent jobs
    sharing only the GPU (and Triton's cache), so that their Triton compiles, most of the time, run in parallel."""
    world_size = WORLD_SIZES[ctx.rank]
    return {name: _report_or_error(harness, ctx, world_size)
            for name, harness in (("exactness", stream_ranks_exactness), ("graphs", stream_ranks_graphs))}


def _report_or_error(harness, ctx, world_size: int) -> dict:
    """The harness's report, or {"error": its traceback}: one harness failing leaves the other's report to its test."""
    try:
        return harness(ctx, world_size)
    except Exception:  # noqa: BLE001 - reported by the test that reads this harness
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def stream_reports() -> dict:
    """{world size: {"exactness": ..., "graphs": ...}} of one spawn, a process per world size."""
    return dict(zip(WORLD_SIZES, _spawn(stream_ranks_reports, len(WORLD_SIZES)), strict=True))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_epilogue_equals_the_two_kernel_path(stream_reports, world_size):
    report = stream_reports[world_size]["exactness"]
    assert "error" not in report, report.get("error")
    print(f"ws {world_size}: {report['calls']} calls compared")
    assert report["mismatch_count"] == 0, report["mismatches"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graph_replays_of_100k_calls_stay_exact(stream_reports, world_size):
    report = stream_reports[world_size]["graphs"]
    assert "error" not in report, report.get("error")
    print(f"ws {world_size}: {report['calls']} calls, {report['replay_ms']:.0f} ms of replays")
    assert report["calls"] > 100_000
    assert report["mismatch_count"] == 0, report["mismatches"]
    for name, expected in report["expected_generations"].items():
        assert report["generations"][name] == [expected] * world_size
    assert "holds 1-64 rows" in report["too_many_rows"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ranks_in_processes_over_cuda_ipc(world_size):
    reports = _spawn(ipc_ranks, world_size, None)
    assert all(r["mismatch_count"] == 0 for r in reports), [r["mismatches"] for r in reports]
    assert len({r["generation"] for r in reports}) == 1
    if _has_pcie():
        assert all(r["flashinfer"] == [] for r in reports), [r["flashinfer"] for r in reports]
    else:
        print("FlashInfer >= 0.7.2 absent: the one kernel was compared with the exact sum and fxfuse's norm kernel only")


@NEEDS_PCIE
def test_the_tuner_times_both_paths_and_writes_their_ranges(tmp_path):
    from fxfuse.op.decide.thresholds import read_table

    path = str(tmp_path / "thresholds.json")
    reports = _spawn(tuner_comparison, 2, path)
    timings = reports[0]["timings"]
    print(f"ranks sharing one GPU (times meaningless): {timings}; {reports[0]['ranges']}")
    assert sorted(timings) == [1, 2, 4, 8, 16] and reports[1]["timings"] == timings  # every rank the same numbers
    assert all(two > 0 and one > 0 for two, one in timings.values())
    entry = read_table(path).lookup(torch.cuda.get_device_name(), 2, 4096, "bfloat16", "pcie")
    assert entry is not None and entry.ranges[-1].mode.value == "pcie"


def test_a_rank_whose_workspace_creation_fails_fails_every_rank():
    reports = _spawn(ipc_ranks, 2, 1)
    assert all(r["error"] and "rank 1" in r["error"] and "cudaMalloc" in r["error"] for r in reports), reports
