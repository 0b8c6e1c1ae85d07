"""Donation never meets aliasing (issue 21, items 1 and 15): when the residual or the RMSNorm weight
shares memory with the all-reduced tensor (the same tensor, a view of it in any shape, a row of it, a
`clone()` that Inductor removes), the donation pass leaves the fused op functional, and every kernel
(CPU reference, C++ fallback, the CUDA dispatch's NCCL plan run on CPU tensors) refuses to all-reduce in
place over memory it reads afterwards. Compiled with the Inductor inner compiler on two gloo ranks,
each such program returns what eager returns (it returned 2 x sum as the residual before)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from nccl_plan_helpers import use_nccl_plans
from toy_graphs import GraphCapture, compile_and_run, fake_process_group

from fxfuse.op.reference import add_rmsnorm, may_overlap, writable_in_place
from fxfuse.passes import donate_allreduce_input
from fxfuse.passes.config import PATTERNS
from fxfuse.runner.launch import run_on_ranks

HIDDEN = 32


def norm(h, w):
    f = h.float()
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def residual_is_input(x, wm, w, r, g):
    y = x @ wm
    h = funcol.all_reduce(y, "sum", g) + y
    return norm(h, w), h


def residual_is_a_view(x, wm, w, r, g):
    y = x @ wm
    h = funcol.all_reduce(y, "sum", g) + y.view(-1, HIDDEN)
    return norm(h, w), h


def residual_is_a_3d_view(x, wm, w, r, g):
    y = (x @ wm).view(1, -1, HIDDEN)
    h = funcol.all_reduce(y, "sum", g) + y.view(1, -1, HIDDEN)
    return norm(h, w), h


def residual_is_a_clone(x, wm, w, r, g):
    y = x @ wm
    h = funcol.all_reduce(y, "sum", g) + y.clone()
    return norm(h, w), h


def weight_is_a_row(x, wm, w, r, g):
    y = x @ wm
    h = funcol.all_reduce(y, "sum", g) + r
    return norm(h, y[0]), h


def nothing_shared(x, wm, w, r, g):
    y = x @ wm
    h = funcol.all_reduce(y, "sum", g) + r
    return norm(h, w), h


ALIASING = (residual_is_input, residual_is_a_view, residual_is_a_3d_view, residual_is_a_clone, weight_is_a_row)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    common = torch.Generator().manual_seed(99)
    return (torch.randn(4, HIDDEN, generator=g), torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5,
            1 + 0.1 * torch.randn(HIDDEN, generator=common), torch.randn(4, HIDDEN, generator=common))


@pytest.mark.parametrize("program", [*ALIASING, nothing_shared], ids=lambda f: f.__name__)
def test_the_pass_donates_only_when_nothing_shares_x(program):
    """The post-grad graph (fake group) after the fusion pass; then the donation pass: it donates the
    one program whose residual and weight are separate tensors, and no other."""
    with fake_process_group() as group:
        capture, _ = compile_and_run(program, *_inputs(0), group.group_name, backend=GraphCapture(patterns=PATTERNS))
        (graph,) = capture.graphs
        assert capture.records[-1].stats.fused == 1
        donated = donate_allreduce_input.run(graph.graph)
    assert donated == (1 if program is nothing_shared else 0)


def test_view_base_follows_views_and_multi_output_views():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.view.default, (x, [-1]))
    unsafe = graph.call_function(torch.ops.aten._unsafe_view.default, (view, [2, 2]))
    parts = graph.call_function(torch.ops.aten.split.Tensor, (unsafe, 1))
    part = graph.call_function(operator.getitem, (parts, 0))
    row = graph.call_function(torch.ops.aten.select.int, (part, 0, 0))
    copy = graph.call_function(torch.ops.aten.clone.default, (row,))
    assert donate_allreduce_input.view_base(row) is x
    assert donate_allreduce_input.view_base(copy) is copy  # a copy is memory of its own


def test_overlap_is_by_memory_span():
    base = torch.zeros(8, 4)
    assert may_overlap(base, base) and may_overlap(base, base[3]) and may_overlap(base[2:5], base[4:6])
    assert not may_overlap(base[:2], base[2:]) and not may_overlap(base, None)
    assert may_overlap(base, base.t()) and not may_overlap(base, torch.zeros(8, 4))
    assert may_overlap(base[:, 0], base[7])  # a strided column reaches the last row
    assert writable_in_place(base, True, None, torch.ones(4)) and not writable_in_place(base, True, base[1])
    assert not writable_in_place(base, False) and not writable_in_place(base.t(), True)


def _kernels_on_rank(ctx, native_cache: str | None):
    """Donated calls whose residual or weight overlaps x, through each kernel; x is a fresh copy each time."""
    import os

    if native_cache is not None:
        os.environ["FXFUSE_NATIVE_CACHE"] = native_cache
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.schema import allreduce_residual_rmsnorm_donate_x

    name = use_nccl_plans(ctx)
    kernels = {
        "reference": lambda x, r, w: allreduce_residual_rmsnorm_donate_x(x, r, w, 1e-6, name),
        "nccl_plan": lambda x, r, w: cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, r, w, 1e-6, name, True),
    }
    if native_cache is not None:
        from fxfuse.op.kernels.native_build import load_native_library

        assert load_native_library() is not None
        cuda_dispatch.allreduce_residual_rmsnorm_cuda(torch.randn(4, HIDDEN), None, torch.ones(HIDDEN), 1e-6, name)
        cuda_dispatch.allreduce_residual_rmsnorm_cuda(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), torch.ones(HIDDEN),
                                                      1e-6, name)  # both shapes decided: C++ runs their later calls
        kernels["cpp"] = lambda x, r, w: torch.ops.fxfuse_native.run(x, r, w, 1e-6, name, True)
    base = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(ctx.rank))
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    out = {}
    for kernel_name, kernel in kernels.items():
        x = base.clone()
        out[(kernel_name, "residual")] = tuple(t.clone() for t in kernel(x, x, weight))
        x = base.clone()
        out[(kernel_name, "weight")] = tuple(t.clone() for t in kernel(x, None, x[0]))
    return base, weight, out


def _check_kernels(results, tolerance):
    (base0, weight, out0), (base1, _, out1) = results
    reduced = base0 + base1
    expected = {"residual": add_rmsnorm(reduced, base0, weight, 1e-6), "weight": add_rmsnorm(reduced, None, base0[0], 1e-6)}
    expected1 = {"residual": add_rmsnorm(reduced, base1, weight, 1e-6), "weight": add_rmsnorm(reduced, None, base1[0], 1e-6)}
    for (kernel, case), value in out0.items():
        torch.testing.assert_close(value, expected[case], **tolerance, msg=lambda m: f"{kernel}, {case}: {m}")
        torch.testing.assert_close(out1[(kernel, case)], expected1[case], **tolerance)


def test_kernels_never_all_reduce_over_memory_they_read_afterwards():
    """Quick loop: the reference and the NCCL plan (Triton's interpreter on CPU), two gloo ranks."""
    _check_kernels(run_on_ranks(_kernels_on_rank, 2, None, timeout_s=120), dict(rtol=1e-5, atol=1e-5))


@pytest.mark.slow
def test_the_cpp_fallback_never_all_reduces_over_memory_it_reads_afterwards(native_library):
    _check_kernels(run_on_ranks(_kernels_on_rank, 2, native_library, timeout_s=300), dict(rtol=1e-5, atol=1e-5))


def _compiled_on_rank(ctx):
    from fxfuse.backend import FxfuseBackend

    out = {}
    for program in (*ALIASING, nothing_shared):
        inputs = _inputs(ctx.rank)
        backend, got = compile_and_run(program, *inputs, ctx.group.group_name, backend=FxfuseBackend(inner="inductor"))
        with torch.no_grad():
            expected = program(*inputs, ctx.group.group_name)
        out[program.__name__] = (got, expected, backend.records[-1].stats.fused)
    return out


@pytest.mark.slow
def test_inductor_compiled_aliasing_programs_equal_eager():
    for out in run_on_ranks(_compiled_on_rank, 2, timeout_s=600):
        for name, (got, expected, fused) in out.items():
            assert fused == 1, name
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
