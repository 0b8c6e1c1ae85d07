"""GPU tests of the all-reduce-only op of tier (b) (`fxfuse::all_reduce`, issue 31) on its three plans.

- TensorRT-LLM (its kAllReduce pattern, one-shot and two-shot) and FlashInfer's PCIe all-reduce: two
  ranks sharing one GPU over gloo (FXFUSE_TOPOLOGY stands in for the fabric), each plan forced, functional
  and in place, 1 to 128 tokens at hidden 7168, against the fp32 sum, then captured in a CUDA graph and
  replayed on fresh input. Correctness only: two ranks on one GPU say nothing of speed.
- NCCL (a one-rank group): a block whose norm feeds a float32 cast (tier b) compiled by fxfuse with
  Inductor (the op re-inplaced through `auto_functionalized`) under CUDA graphs, static and dynamic shapes,
  against the same block compiled by Inductor alone; the calls counted as the all-reduce-only op's.
Run with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch
from flashinfer_gpu import CUDA_GPU_MARKS, FLASHINFER_GPU_MARKS, NEEDS_PCIE, inputs

from fxfuse.runner.launch import run_on_ranks

pytestmark = CUDA_GPU_MARKS

TOKENS = (1, 16, 128)
HIDDEN = 7168
TOLERANCE = 1e-2


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


def _forced_plan_checks(ctx, topology: str, modes: tuple[str, ...]) -> dict:
    """Each forced plan's `all_reduce`, functional and in place, eagerly and replayed from a CUDA graph."""
    os.environ["FXFUSE_TOPOLOGY"] = topology
    os.environ.setdefault("FXFUSE_PCIE_PROFILE", "rootcplx")
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    from fxfuse.op.decide.modes import FusionMode
    from fxfuse.op.runtime.prepare import forced_plan

    device = torch.device("cuda", torch.cuda.current_device())
    report: dict = {}
    for mode_name in modes:
        plan = forced_plan(ctx.group, FusionMode(mode_name), HIDDEN, torch.bfloat16, max(TOKENS))
        if plan is None:
            report[mode_name] = "no workspace"
            continue
        plan.only_all_reduce = True
        for tokens in TOKENS:
            if mode_name == "twoshot" and tokens <= ctx.world_size:
                continue
            x, xs, _, _ = inputs(ctx.rank, ctx.world_size, tokens, 0, device, HIDDEN)
            expected = sum(t.float() for t in xs)
            out = plan.all_reduce(x, False)
            in_place = x.clone()
            returned = plan.all_reduce(in_place, True)
            report[(mode_name, tokens)] = (_relative_error(out, expected), _relative_error(in_place, expected),
                                           returned is in_place, torch.equal(x, inputs(ctx.rank, ctx.world_size, tokens, 0,
                                                                                      device, HIDDEN)[0]))
        x, _, _, _ = inputs(ctx.rank, ctx.world_size, 16, 1, device, HIDDEN)
        plan.all_reduce(x, False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = plan.all_reduce(x, False)
        errors = []
        for seed in (2, 3):
            fresh, fresh_xs, _, _ = inputs(ctx.rank, ctx.world_size, 16, seed, device, HIDDEN)
            x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            errors.append(_relative_error(captured, sum(t.float() for t in fresh_xs)))
        report[(mode_name, "graph")] = errors
        del graph
    import fxfuse

    fxfuse.destroy_workspaces(ctx.group, graphs_released=True)
    return report


def _check(reports: list[dict], modes: tuple[str, ...]) -> None:
    for report in reports:
        for mode in modes:
            assert report.get(mode) != "no workspace", report
            graph_errors = report[(mode, "graph")]
            assert max(graph_errors) < TOLERANCE, (mode, graph_errors)
        checked = [key for key in report if isinstance(key, tuple) and key[1] != "graph"]
        assert len(checked) >= len(modes) * 2, report
        for key in checked:
            functional, in_place, returned_x, x_untouched = report[key]
            assert functional < TOLERANCE and in_place < TOLERANCE, (key, functional, in_place)
            assert returned_x and x_untouched, key


def test_trtllm_all_reduce_only():
    reports = run_on_ranks(_forced_plan_checks, 2, "nvswitch", ("oneshot", "twoshot"), timeout_s=900)
    _check(reports, ("oneshot", "twoshot"))


for _mark in FLASHINFER_GPU_MARKS[len(CUDA_GPU_MARKS):]:
    test_trtllm_all_reduce_only = _mark(test_trtllm_all_reduce_only)


@NEEDS_PCIE
def test_pcie_all_reduce_only():
    reports = run_on_ranks(_forced_plan_checks, 2, "pcie", ("pcie",), timeout_s=600)
    _check(reports, ("pcie",))


def _tier_b_block(x, residual, weight, group_name):
    import torch.distributed._functional_collectives as funcol

    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    h = hidden.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight
    return normed.float() * 0.5, hidden  # a float32 cast and a scale: Inductor's to fuse into the norm


def _nccl_tier_b_checks(ctx) -> dict:
    torch.cuda.set_device(0)
    from fxfuse.backend import FxfuseBackend
    from fxfuse.op.runtime.plans import fusion_stats, reset_fusion_stats

    device, name = torch.device("cuda", 0), ctx.group.group_name
    report = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        backend = FxfuseBackend(fuse_without_fast_kernel=True)
        fxfuse_fn = torch.compile(lambda x, r, w: _tier_b_block(x, r, w, name), backend=backend, dynamic=dynamic)
        inductor_fn = torch.compile(lambda x, r, w: _tier_b_block(x, r, w, name), backend="inductor", dynamic=dynamic)
        reset_fusion_stats()
        for tokens in (1, 16, 128, 1024):
            g = torch.Generator(device="cpu").manual_seed(tokens)
            x, residual = (torch.randn(tokens, HIDDEN, generator=g).to(device, torch.bfloat16) for _ in range(2))
            weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(device, torch.bfloat16)
            static = [t.clone() for t in (x, residual, weight)]
            for fn in (fxfuse_fn, inductor_fn):
                fn(*static)  # compile and warm outside capture
            outputs = {}
            for label, fn in (("fxfuse", fxfuse_fn), ("inductor", inductor_fn)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fn(*static)
                graph.replay()
                torch.cuda.synchronize()
                outputs[label] = [t.clone() for t in out]
            report[(dynamic, tokens)] = [_relative_error(a, b.float()) for a, b in zip(outputs["fxfuse"], outputs["inductor"])]
        report[(dynamic, "stats")] = backend.records[-1].stats.fast_all_reduces
        report[(dynamic, "calls")] = fusion_stats()["all_reduce"]
    return report


def test_nccl_tier_b_under_cuda_graphs_matches_inductor():
    (report,) = run_on_ranks(_nccl_tier_b_checks, 1, device="cuda", timeout_s=600)
    for dynamic in (False, True):
        assert report[(dynamic, "stats")] == 1, report
        calls = report[(dynamic, "calls")]
        assert calls and all(mode == "fallback" for (_, mode, _, _) in calls), calls
        for tokens in (1, 16, 128, 1024):
            assert max(report[(dynamic, tokens)]) < TOLERANCE, (dynamic, tokens, report[(dynamic, tokens)])
