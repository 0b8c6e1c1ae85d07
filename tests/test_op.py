"""The fused op `fxfuse::allreduce_residual_rmsnorm`: schema, fake kernel, reference numerics on two
gloo ranks, no aliasing, the donating overloads, and the CUDA dispatch's NCCL plan (run on CPU
tensors with gloo and Triton's interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from nccl_plan_helpers import use_nccl_plans
from toy_graphs import fake_process_group

from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.schema import (
    allreduce_residual_rmsnorm,
    allreduce_residual_rmsnorm_donate_x,
    allreduce_residual_rmsnorm_donate_x_tensor_eps,
    allreduce_residual_rmsnorm_tensor_eps,
)
from fxfuse.runner.launch import run_on_ranks

SCHEMA = (
    "fxfuse::allreduce_residual_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name,"
    " float weight_offset=0., bool weight_in_fp32=False) -> (Tensor normed, Tensor residual_out)"
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((5, 32), (2, 3, 32))


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def test_schema_is_the_contract():
    assert str(allreduce_residual_rmsnorm._schema) == SCHEMA


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_opcheck(group, with_residual):
    """Schema, autograd registration, fake kernel and AOT dispatch agree with the CPU kernel."""
    residual = torch.randn(3, 16) if with_residual else None
    torch.library.opcheck(allreduce_residual_rmsnorm, (torch.randn(3, 16), residual, torch.randn(16), 1e-6, group.group_name))


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_tensor_eps_overload_matches_float_overload(group, with_residual):
    """`tensor_eps` (eps as a 0-dim CPU tensor, as dynamic=True graphs carry it) = the float overload."""
    x, weight = torch.randn(3, 16), torch.randn(16)
    residual = torch.randn(3, 16) if with_residual else None
    eps = torch.tensor(1e-2, dtype=torch.float64)
    torch.library.opcheck(allreduce_residual_rmsnorm_tensor_eps, (x, residual, weight, eps, group.group_name))
    torch.testing.assert_close(
        allreduce_residual_rmsnorm_tensor_eps(x, residual, weight, eps, group.group_name),
        allreduce_residual_rmsnorm(x, residual, weight, 1e-2, group.group_name),
        rtol=0,
        atol=0,
    )


def test_fake_kernel_traces_symbolic_token_counts(group):
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(x, residual, weight):
        return allreduce_residual_rmsnorm(x, residual, weight, 1e-6, group.group_name)

    gm = make_fx(call, tracing_mode="symbolic")(torch.randn(7, 16), torch.randn(7, 16), torch.randn(16))
    (fused,) = gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm)
    normed, residual_out = fused.meta["val"]
    assert isinstance(normed.shape[0], torch.SymInt) and normed.shape[1] == 16
    assert residual_out.shape == normed.shape


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_outputs_never_alias_inputs(group, with_residual):
    x, weight = torch.randn(4, 16), torch.randn(16)
    residual = torch.randn(4, 16) if with_residual else None
    inputs = [t for t in (x, residual, weight) if t is not None]
    outputs = allreduce_residual_rmsnorm(x, residual, weight, 1e-6, group.group_name)
    pointers = {t.untyped_storage().data_ptr() for t in inputs}
    assert all(out.untyped_storage().data_ptr() not in pointers for out in outputs)
    assert outputs[0].untyped_storage().data_ptr() != outputs[1].untyped_storage().data_ptr()


def _reference_cases():
    return [(dtype, shape, with_residual) for dtype in DTYPES for shape in SHAPES for with_residual in (True, False)]


def _op_on_rank(ctx):
    """Call the op for every case with rank-specific x; return inputs and outputs for the parent."""
    results = []
    for dtype, shape, with_residual in _reference_cases():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + ctx.rank)).to(dtype)
        common = torch.Generator().manual_seed(99)
        residual = torch.randn(shape, generator=common).to(dtype) if with_residual else None
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=common)).to(dtype)
        normed, residual_out = allreduce_residual_rmsnorm(x, residual, weight, 1e-5, ctx.group.group_name)
        results.append((x, residual, weight, normed, residual_out))
    return results


@pytest.mark.slow
def test_reference_numerics_on_two_gloo_ranks():
    """all_reduce in the input dtype, add rounded to it, fp32 norm, cast back, times weight:
    bit-identical to that arithmetic, identical on both ranks, and close to a float64 evaluation."""
    rank0, rank1 = run_on_ranks(_op_on_rank, 2, timeout_s=300)
    for (dtype, shape, _), case0, case1 in zip(_reference_cases(), rank0, rank1):
        (x0, residual, weight, normed, residual_out), (x1, *_, normed1, residual_out1) = case0, case1
        torch.testing.assert_close((normed1, residual_out1), (normed, residual_out), rtol=0, atol=0)
        assert normed.dtype == residual_out.dtype == dtype and normed.shape == residual_out.shape == shape

        expected_normed, expected_residual = add_rmsnorm(x0 + x1, residual, weight, 1e-5)
        torch.testing.assert_close((normed, residual_out), (expected_normed, expected_residual), rtol=0, atol=0)

        exact = x0.double() + x1.double() + (0 if residual is None else residual.double())
        exact_normed = exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        tolerance = 1e-5 if dtype == torch.float32 else 3 * torch.finfo(dtype).eps
        torch.testing.assert_close(normed.double(), exact_normed, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------- the donating overloads


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_donating_overloads_match_the_functional_op(group, with_residual):
    """`donate_x` may overwrite x; its outputs equal the functional op's and never alias x."""
    x, weight = torch.randn(3, 16), torch.randn(16)
    residual = torch.randn(3, 16) if with_residual else None
    expected = allreduce_residual_rmsnorm(x.clone(), residual, weight, 1e-6, group.group_name)
    torch.library.opcheck(allreduce_residual_rmsnorm_donate_x, (x.clone(), residual, weight, 1e-6, group.group_name))
    donated = x.clone()
    got = allreduce_residual_rmsnorm_donate_x(donated, residual, weight, 1e-6, group.group_name)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert all(out.untyped_storage().data_ptr() != donated.untyped_storage().data_ptr() for out in got)
    eps = torch.tensor(1e-6, dtype=torch.float64)
    torch.testing.assert_close(
        allreduce_residual_rmsnorm_donate_x_tensor_eps(x.clone(), residual, weight, eps, group.group_name), expected,
        rtol=0, atol=0)


# ---------------------------------------------------------------- the CUDA dispatch, run on CPU tensors
# The plans' NCCL path is the group's all-reduce plus the Triton add-RMSNorm kernel; on CPU, gloo and
# Triton's interpreter run it (float32/float16 only: the interpreter computes bfloat16 wrongly).


def _dispatch_on_rank(ctx):
    """On each rank: calls through fxfuse.op.runtime.cuda_dispatch with a group config that selects NCCL."""
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.plans import fusion_stats

    name = use_nccl_plans(ctx)
    built = []
    real_plan_call = cuda_dispatch.plan_call
    cuda_dispatch.plan_call = lambda *a: built.append(a) or real_plan_call(*a)
    out = {"cases": []}
    for dtype in (torch.float32, torch.float16):
        for shape, with_residual in (((5, 64), True), ((2, 3, 100), False)):
            g = torch.Generator().manual_seed(10 + ctx.rank)
            x = torch.randn(shape, generator=g).to(dtype)
            common = torch.Generator().manual_seed(7)
            residual = torch.randn(shape, generator=common).to(dtype) if with_residual else None
            weight = (1 + 0.1 * torch.randn(shape[-1], generator=common)).to(dtype)
            functional = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight, 1e-5, name)
            donated_x = x.clone()
            donated = cuda_dispatch.allreduce_residual_rmsnorm_cuda(donated_x, residual, weight, 1e-5, name, x_donated=True)
            # a view at a 4-byte offset: not 16-byte aligned, copied before the kernels
            padded = torch.cat([torch.zeros(1, dtype=dtype), x.flatten()])[1:].view(shape)
            unaligned = cuda_dispatch.allreduce_residual_rmsnorm_cuda(padded, residual, weight, 1e-5, name)
            out["cases"].append(dict(dtype=dtype, x=x, residual=residual, weight=weight, functional=functional,
                                     donated=donated, unaligned=unaligned, x_changed_by_donation=not torch.equal(donated_x, x),
                                     padded_ptr_mod_16=padded.data_ptr() % 16,
                                     aliases=[o.untyped_storage().data_ptr() == donated_x.untyped_storage().data_ptr() for o in donated]))
    out["plans_built"] = len(built)
    out["stats"] = fusion_stats()
    try:  # a known shape with a weight of the wrong width: refused, although the shape's plan exists
        cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight[:-1], 1e-5, name)
    except ValueError as error:
        out["bad_weight"] = str(error)
    cuda_dispatch.forget_plans(name)
    cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight, 1e-5, name)
    out["plans_after_forget"] = len(built)
    return out


@pytest.mark.slow
def test_cuda_dispatch_nccl_plan_matches_the_reference_and_caches_its_plan():
    rank0, rank1 = run_on_ranks(_dispatch_on_rank, 2, timeout_s=300)
    for case0, case1 in zip(rank0["cases"], rank1["cases"]):
        expected = add_rmsnorm(case0["x"] + case1["x"], case0["residual"], case0["weight"], 1e-5)
        tolerance = dict(rtol=1e-6, atol=1e-6) if case0["dtype"] == torch.float32 else dict(rtol=1e-3, atol=1e-3)
        for key in ("functional", "donated", "unaligned"):
            torch.testing.assert_close(case0[key][1], expected[1], rtol=0, atol=0)  # the add: exact
            torch.testing.assert_close(case0[key][0], expected[0], **tolerance)  # the norm: same rounding order
            torch.testing.assert_close(case0[key], case1[key], rtol=0, atol=0)  # same on both ranks
        assert case0["x_changed_by_donation"] and not any(case0["aliases"])
        assert case0["padded_ptr_mod_16"] != 0
    # one plan per (shape, dtype, residual) key, not per call: 4 keys, 12 calls
    assert rank0["plans_built"] == 4 and rank0["plans_after_forget"] == 5
    assert "weight [99] must be [hidden] = [100]" in rank0["bad_weight"]
    assert rank0["stats"]["fused"] == {}
    assert sum(rank0["stats"]["fallback"].values()) == 12
    assert all("PCIe group, but PCIe all-reduce unavailable" in reason for reason in rank0["stats"]["fallback"])


@pytest.mark.slow
def test_cpu_paths_never_import_flashinfer():
    """Importing the op, its CUDA kernel module and the backend loads no FlashInfer code."""
    code = (
        "import sys, fxfuse.op.schema, fxfuse.op.runtime.registration, fxfuse.op.runtime.cuda_dispatch, fxfuse.op.runtime.prepare, "
        "fxfuse.backend\n"
        "loaded = [m for m in sys.modules if m.startswith('flashinfer')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
