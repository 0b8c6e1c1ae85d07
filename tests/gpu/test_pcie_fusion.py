"""GPU tests of the PCIe path (FlashInfer >= 0.7.2): FlashInfer's PCIe IPC all-reduce, then the fused
add-RMSNorm kernel, as the fused op's default on PCIe groups. Two ranks share one GPU over gloo;
FXFUSE_TOPOLOGY=pcie stands in for the PCIe fabric they lack and FXFUSE_PCIE_PROFILE=rootcplx for
FlashInfer's topology probe (meaningless on one GPU).

Checked against an fp32 reference for 1 to 128 tokens at hidden 7168 and 4096, eagerly and captured
in a CUDA graph replayed on fresh input (after `fxfuse.prepare`, which resolves every launch
configuration outside capture), with and without a residual; every call takes the PCIe plan; a call
from a second stream is ordered after the first stream's work. Run with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch
from flashinfer_gpu import EPS, PCIE_GPU_MARKS, fused_calls, inputs, reference, rel_errs

from fxfuse.runner.launch import run_on_ranks

pytestmark = PCIE_GPU_MARKS

TOLERANCE = 1e-2
TOKENS = (1, 2, 3, 7, 16, 64, 128)


def pcie_checks(ctx) -> dict:
    os.environ.update(FXFUSE_TOPOLOGY="pcie", FXFUSE_PCIE_PROFILE="rootcplx")
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    import fxfuse
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.plans import fusion_stats
    from fxfuse.op.runtime.workspace import PCIE
    from fxfuse.op.schema import allreduce_residual_rmsnorm

    device, name = torch.device("cuda", torch.cuda.current_device()), ctx.group.group_name
    report: dict = {"eager": {}, "graph": {}}
    for hidden in (7168, 4096):
        ready = fxfuse.prepare(ctx.group, hidden, torch.bfloat16, max_tokens=max(TOKENS))
        report[f"ready_{hidden}"] = (ready, PCIE.failure(name, hidden, torch.bfloat16))
        if not ready:
            continue
        for tokens in TOKENS:
            x, xs, residual, weight = inputs(ctx.rank, ctx.world_size, tokens, 0, device, hidden)
            for with_residual in (True, False):
                res = residual if with_residual else None
                before = fused_calls().get("pcie", 0)
                out = allreduce_residual_rmsnorm(x, res, weight, EPS, name)
                report["eager"][(hidden, tokens, with_residual)] = (fused_calls().get("pcie", 0) - before,
                                                                    rel_errs(out, reference(xs, res, weight)))
        for tokens in (1, 16, 128):
            x, _, residual, weight = inputs(ctx.rank, ctx.world_size, tokens, 1, device, hidden)
            allreduce_residual_rmsnorm(x, residual, weight, EPS, name)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = allreduce_residual_rmsnorm(x, residual, weight, EPS, name)
            errors = []
            for seed in (2, 3):
                fresh_x, fresh_xs, fresh_residual, _ = inputs(ctx.rank, ctx.world_size, tokens, seed, device, hidden)
                x.copy_(fresh_x)
                residual.copy_(fresh_residual)
                graph.replay()
                torch.cuda.synchronize()
                errors.append(rel_errs(captured, reference(fresh_xs, fresh_residual, weight)))
            report["graph"][(hidden, tokens)] = errors
            del graph
    x, xs, residual, weight = inputs(ctx.rank, ctx.world_size, 16, 4, device, 7168)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = allreduce_residual_rmsnorm(x, residual, weight, EPS, name)
    on_main = allreduce_residual_rmsnorm(x, residual, weight, EPS, name)
    torch.cuda.synchronize()
    report["streams"] = [rel_errs(out, reference(xs, residual, weight)) for out in (on_side, on_main)]
    report["plans"] = sorted({type(p).__name__ for p in cuda_dispatch._PLANS.values()})
    report["stats"] = fusion_stats()
    fxfuse.destroy_workspaces(ctx.group, graphs_released=True)
    return report


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(pcie_checks, 2, timeout_s=600)


def test_pcie_workspaces_are_ready(reports):
    for report in reports:
        for hidden in (7168, 4096):
            ready, failure = report[f"ready_{hidden}"]
            assert ready, failure


def test_pcie_path_matches_fp32_reference_for_1_to_128_tokens(reports):
    for report in reports:
        assert len(report["eager"]) == 2 * len(TOKENS) * 2
        for key, (pcie_calls, errors) in report["eager"].items():
            assert pcie_calls == 1 and max(errors) < TOLERANCE, (key, pcie_calls, errors)
        assert report["plans"] == ["PciePlan"] and report["stats"]["fallback"] == {}


def test_pcie_path_replays_in_cuda_graphs_on_fresh_input(reports):
    for report in reports:
        assert len(report["graph"]) == 6
        for key, errors in report["graph"].items():
            assert all(max(e) < TOLERANCE for e in errors), (key, errors)


def test_calls_from_two_streams_are_ordered(reports):
    for report in reports:
        assert all(max(e) < TOLERANCE for e in report["streams"]), report["streams"]
