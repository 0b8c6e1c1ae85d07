"""GPU tests of the fused op's norm variants (issue 24) on every path two ranks sharing one GPU can run:
Gemma's `1 + w` (`weight_offset=1`, weight in float32), the weight applied in float32, a float32 weight
and a float32 residual stream (16-bit activations), each through the NCCL plan, the PCIe plan
(FlashInfer >= 0.7.2) and the TensorRT-LLM one-shot plan (16-bit residual and weight only; the offset
from FlashInfer 0.7.2, whose kernel takes a weight bias), against the reference arithmetic in float32.
Then a Gemma-style decoder layer compiled with `backend="fxfuse"` on CUDA (its sandwich site in tier (b)): the outputs
against the same layer run eagerly.

FXFUSE_TOPOLOGY=nvswitch and FXFUSE_PCIE_PROFILE=rootcplx stand in for the fabric one GPU lacks (as in
test_flashinfer_fusion.py and test_pcie_fusion.py). Run with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch
from flashinfer_gpu import CUDA_GPU_MARKS, EPS, NORM_VARIANTS, inputs, reference, rel_errs, trtllm_takes, variant_arguments

from fxfuse.op.decide.flashinfer_version import installed_features
from fxfuse.runner.launch import run_on_ranks

pytestmark = CUDA_GPU_MARKS

HIDDEN = 4096
TOKENS = 16
TOLERANCE = 1e-2  # relative L2 error; bf16 rounding alone gives about 3e-3


def _plans(ctx, torch_dtype):
    from fxfuse.op.decide.modes import FusionMode
    from fxfuse.op.runtime.prepare import forced_plan

    features = installed_features()
    plans = {"nccl": forced_plan(ctx.group, FusionMode.FALLBACK, HIDDEN, torch_dtype, TOKENS)}
    if features.pcie:
        plans["pcie"] = forced_plan(ctx.group, FusionMode.PCIE, HIDDEN, torch_dtype, TOKENS)
    if features.trtllm:
        plans["trtllm_oneshot"] = forced_plan(ctx.group, FusionMode.ONESHOT, HIDDEN, torch_dtype, TOKENS)
    return plans, features


def variant_checks(ctx) -> dict:
    os.environ.update(FXFUSE_TOPOLOGY="nvswitch", FXFUSE_PCIE_PROFILE="rootcplx")
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    import fxfuse

    device = torch.device("cuda", torch.cuda.current_device())
    plans, features = _plans(ctx, torch.bfloat16)
    report: dict = {"plans": {name: plan is not None for name, plan in plans.items()}, "errors": {}}
    x, xs, residual, weight = inputs(ctx.rank, ctx.world_size, TOKENS, 0, device, HIDDEN)
    weight = weight - 1  # zero-centred, as Gemma stores it
    for case in NORM_VARIANTS:
        res, w, norm = variant_arguments(case, residual, weight)
        for name, plan in plans.items():
            if plan is None or (name.startswith("trtllm") and not trtllm_takes(case, features)):
                continue
            normed, residual_out = plan(x.clone(), res, w, EPS, False, norm)
            torch.cuda.synchronize()
            report["errors"][(case, name)] = (normed.dtype, residual_out.dtype,
                                              rel_errs((normed, residual_out), reference(xs, res, weight, norm[0])))
    fxfuse.destroy_workspaces(ctx.group, graphs_released=True)
    report["compiled"] = _compiled_gemma_layer(ctx, device)
    return report


def _compiled_gemma_layer(ctx, device) -> dict:
    """A Gemma-style layer (sandwich norms, `1 + w`) and a float32-residual-stream layer, compiled with the
    fxfuse backend (eager inner) on CUDA: the sites fused with and without a residual, the fast all-reduces
    (tier (b)) and the all-reduces left, and the outputs against eager."""
    import torch.distributed._functional_collectives as funcol

    from fxfuse.backend import FxfuseBackend

    def gemma_norm(h, w):
        c = h.float()
        return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).type_as(h)

    def layers(y1, y2, r, r32, w1, w2):
        post_attention = gemma_norm(funcol.all_reduce(y1, "sum", ctx.group), w1)  # Gemma's sandwich norm
        h32 = funcol.all_reduce(y2, "sum", ctx.group).float() + r32  # a float32 residual stream
        c = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)
        return r + post_attention, (c * w2.float()).to(y2.dtype), h32

    g = torch.Generator().manual_seed(ctx.rank)
    common = torch.Generator().manual_seed(7)
    args = [torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    args += [torch.randn(TOKENS, HIDDEN, generator=common).to(device, torch.bfloat16),
             torch.randn(TOKENS, HIDDEN, generator=common).to(device),
             (0.1 * torch.randn(HIDDEN, generator=common)).to(device, torch.bfloat16),
             (0.1 * torch.randn(HIDDEN, generator=common)).to(device, torch.bfloat16)]
    backend = FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = layers(*args)
        compiled = torch.compile(layers, backend=backend, fullgraph=True)(*args)
    torch.cuda.synchronize()
    stats = backend.records[0].stats
    return {"fused": (stats.fused_with_residual, stats.fused_without_residual, stats.fast_all_reduces,
                      stats.allreduces_after),
            "errors": [((c.float() - e.float()).norm() / e.float().norm()).item() for c, e in zip(compiled, eager)],
            "dtypes": [c.dtype == e.dtype for c, e in zip(compiled, eager)]}


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(variant_checks, 2, timeout_s=900)


def test_every_plan_runs_every_variant_it_is_given(reports):
    for report in reports:
        assert report["plans"]["nccl"]
        for (case, plan), (normed_dtype, residual_dtype, errors) in report["errors"].items():
            assert normed_dtype == torch.bfloat16, (case, plan)
            assert residual_dtype == (torch.float32 if NORM_VARIANTS[case][3] else torch.bfloat16), (case, plan)
            assert max(errors) < TOLERANCE, (case, plan, errors)
        ran = {case for case, _ in report["errors"]}
        assert ran == set(NORM_VARIANTS)


def test_compiled_gemma_and_float32_stream_layers_fuse_and_match_eager(reports):
    for report in reports:
        compiled = report["compiled"]
        # the float32-stream site fused; Gemma's sandwich site in tier (b): its norm's output feeds the residual
        # add, which Inductor fuses into the norm's kernel, so a fast all-reduce runs and Inductor keeps the norm
        assert compiled["fused"] == (1, 0, 1, 0)
        assert all(compiled["dtypes"])
        assert max(compiled["errors"]) < TOLERANCE, compiled
