"""The fused op's norm variants (issue 24): the weight applied in float32 before the one cast back
(`F.rms_norm`), with an offset (Gemma's zero-centred `1 + weight`), and a float32 residual stream
with 16-bit activations (Megatron's fp32 residual connection). Each against the arithmetic the model
code writes, on two gloo ranks: the CPU kernel bit for bit, the CUDA dispatch's NCCL plan (its Triton
kernel under the CPU interpreter) within a rounding step; and the checks every kernel makes."""

from __future__ import annotations

import pytest
import torch
from nccl_plan_helpers import use_nccl_plans
from toy_graphs import fake_process_group

from fxfuse.op.schema import allreduce_residual_rmsnorm
from fxfuse.runner.launch import run_on_ranks

HIDDEN = 64


def gemma_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward: float32 norm times (1 + weight) in float32, cast back."""
    x = h.float()
    output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(h)


def fp32_residual_norm(h32: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """A float32 residual stream's norm: in float32 throughout, the weight too, then cast for the next GEMM."""
    return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype)


def _variants_on_rank(ctx, dtype):
    from fxfuse.op.runtime import cuda_dispatch

    name = use_nccl_plans(ctx)
    g = torch.Generator().manual_seed(ctx.rank)
    common = torch.Generator().manual_seed(7)
    x = torch.randn(3, HIDDEN, generator=g).to(dtype)
    residual = torch.randn(3, HIDDEN, generator=common).to(dtype)
    residual32 = torch.randn(3, HIDDEN, generator=common)
    weight = (0.1 * torch.randn(HIDDEN, generator=common)).to(dtype)
    weight32 = 1 + 0.1 * torch.randn(HIDDEN, generator=common)
    cases = {
        "gemma": (residual, weight, 1.0, True),
        "weight_in_fp32": (residual, weight, 0.0, True),
        "fp32_residual": (residual32, weight, 0.0, True),
        "fp32_residual_fp32_weight": (residual32, weight32, 0.0, True),
    }
    out = {}
    for case, (res, w, offset, fp32) in cases.items():
        reference_kernel = allreduce_residual_rmsnorm(x, res, w, 1e-6, name, offset, fp32)
        nccl_plan = None
        if dtype == torch.float16:
            nccl_plan = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x.clone(), res, w, 1e-6, name, True, offset, fp32)
        out[case] = (x, res, w, reference_kernel, nccl_plan)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_norm_variants_equal_the_model_code(dtype):
    rank0, rank1 = run_on_ranks(_variants_on_rank, 2, dtype, timeout_s=300)
    for case, (x0, residual, weight, (normed, residual_out), plan) in rank0.items():
        summed = x0 + rank1[case][0]  # the all-reduce in x's dtype
        if residual.dtype == torch.float32:
            expected_residual = summed.float() + residual
            expected = fp32_residual_norm(expected_residual, weight, 1e-6, dtype)
        else:
            expected_residual = summed + residual
            expected = gemma_norm(expected_residual, weight, 1e-6) if case == "gemma" else \
                torch.nn.functional.rms_norm(expected_residual.float(), (HIDDEN,), weight.float(), 1e-6).to(dtype)
        assert residual_out.dtype == residual.dtype and normed.dtype == dtype, case
        torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0, msg=lambda m: f"{case}: {m}")
        exact = dict(rtol=0, atol=0) if case != "weight_in_fp32" else dict(rtol=2 ** -7, atol=1e-3)  # F.rms_norm's own fp32 order
        torch.testing.assert_close(normed, expected, **exact, msg=lambda m: f"{case}: {m}")
        if plan is not None:  # Triton's CPU interpreter computes bfloat16 wrongly (DEVELOPERS.md): fp16 only
            plan_normed, plan_residual_out = plan
            torch.testing.assert_close(plan_residual_out, expected_residual, rtol=0, atol=0,
                                       msg=lambda m: f"{case}, NCCL plan: {m}")
            step = torch.finfo(dtype).eps
            torch.testing.assert_close(plan_normed, normed, rtol=step, atol=step, msg=lambda m: f"{case}, NCCL plan: {m}")


def test_a_float32_residual_needs_the_weight_in_float32():
    with fake_process_group() as group:
        x = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="needs the weight applied in float32"):
            allreduce_residual_rmsnorm(x, torch.randn(2, HIDDEN), torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6, group.group_name)
        with pytest.raises(ValueError, match="weight dtype torch.float32 must be x's torch.bfloat16$"):
            allreduce_residual_rmsnorm(x, None, torch.ones(HIDDEN), 1e-6, group.group_name)
        normed, residual_out = allreduce_residual_rmsnorm(x, torch.randn(2, HIDDEN), torch.ones(HIDDEN), 1e-6,
                                                          group.group_name, 0.0, True)
        assert (normed.dtype, residual_out.dtype) == (torch.bfloat16, torch.float32)
        torch.library.opcheck(torch.ops.fxfuse.allreduce_residual_rmsnorm.default,
                              (x, torch.randn(2, HIDDEN), torch.ones(HIDDEN), 1e-6, group.group_name, 1.0, True))
