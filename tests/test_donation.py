"""The donation pass under Inductor: each fused op becomes its `donate_x` twin, and Inductor's
re-inplacing hands it the matmul output itself (no copy) where that output is dead, and a copy where
x is a graph input; numerics equal eager. Two gloo ranks, Inductor on CPU."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from fxfuse.runner.launch import run_on_ranks

HIDDEN = 32


def block(x, w, residual, norm_weight, group_name):
    """Row-parallel matmul, all-reduce, residual add, transformers-style RMSNorm."""
    hidden = funcol.all_reduce(x @ w, "sum", group_name) + residual
    h = hidden.float()
    normed = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype)
    return normed, hidden


def reduce_input_directly(x, residual, norm_weight, group_name):
    """The all-reduced value is a graph input: Inductor must not let the op write into it."""
    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    h = hidden.float()
    return norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype), hidden


def compile_on_rank(ctx):
    from torch._inductor.utils import run_and_get_code

    from fxfuse.backend import FxfuseBackend

    g = torch.Generator().manual_seed(ctx.rank)
    x, w = torch.randn(6, 16, generator=g), torch.randn(16, HIDDEN, generator=g)
    residual, norm_weight = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(9)), torch.randn(HIDDEN)
    out = {}
    for name, fn, args in (("matmul", block, (x, w, residual, norm_weight)),
                           ("input", reduce_input_directly, (x @ w, residual, norm_weight))):
        backend = FxfuseBackend(inner="inductor")
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        kept = args[0].clone()
        with torch.no_grad():
            result, (code, *_) = run_and_get_code(compiled, *args, ctx.group.group_name)
            expected = fn(*args, ctx.group.group_name)
        out[name] = dict(code=code, result=result, expected=expected, fused=backend.records[-1].stats.fused,
                         input_unchanged=torch.equal(args[0], kept))
    return out


@pytest.mark.slow
def test_inductor_donates_the_dead_matmul_output_and_copies_a_graph_input():
    for out in run_on_ranks(compile_on_rank, 2, timeout_s=600):
        for case in out.values():
            assert case["fused"] == 1  # the recorded graph shows the functional op
            torch.testing.assert_close(case["result"], case["expected"], rtol=1e-5, atol=1e-5)
            assert case["input_unchanged"]
        matmul = out["matmul"]["code"]
        call = re.search(r"torch\.ops\.fxfuse\.allreduce_residual_rmsnorm\.donate_x(?:_tensor_eps)?(?:\.default)?\((\w+)", matmul)
        assert call, matmul
        # the donated buffer is the one the matmul wrote, and nothing copies it first
        assert re.search(rf"extern_kernels\.mm\([^\n]*out={call.group(1)}\)", matmul), matmul
        assert "clone" not in matmul and "copy_" not in matmul
        graph_input = out["input"]["code"]
        donated = re.search(r"allreduce_residual_rmsnorm\.donate_x(?:_tensor_eps)?(?:\.default)?\(([^,]+),", graph_input)
        assert donated and not donated.group(1).startswith("arg"), graph_input  # a copy of the input, never the input
