"""Compile-time capability: CUDA sites where no fused all-reduce kernel can run are left to Inductor
(with the reason in `explain_unfused`), unless the backend is told to fuse them anyway; CPU sites are
always fused (the reference kernel). Every branch of `fused_kernel_unavailable`, and a compile on
fake CUDA tensors (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from toy_graphs import compile_and_run, fake_process_group, funcol_all_reduce, rmsnorm_transformers

from fxfuse.backend import FxfuseBackend
from fxfuse.op import capability
from fxfuse.op.flashinfer_version import features
from fxfuse.op.settings import FusionSettings
from fxfuse.passes.unfused_reasons import explain_unfused
from fxfuse.passes.pattern_support import ALL_REDUCE


@pytest.fixture
def machine(monkeypatch):
    """Set what `fused_kernel_unavailable` sees: FlashInfer version, GPU arch, settings."""
    def set_machine(version="0.7.2", sm=90, settings=FusionSettings()):
        monkeypatch.setattr(capability, "installed_features", lambda: features(version))
        monkeypatch.setattr(capability, "current_settings", lambda: settings)
        monkeypatch.setattr(capability, "_sm", lambda: sm)
    return set_machine


@pytest.mark.parametrize(
    "machine_args, dtype, world_size, reason_part",
    [
        ({}, torch.bfloat16, 2, None),
        ({"version": "0.6.3", "sm": 90}, torch.float16, 16, None),  # TRT-LLM runs 16 ranks
        ({"version": "0.7.2", "sm": 80}, torch.bfloat16, 8, None),  # A100: the PCIe all-reduce runs any arch
        ({"version": "0.6.3", "sm": 120}, torch.bfloat16, 8, "world size 8"),  # SM 12 before 0.6.17, no PCIe kernel
        ({"version": "0.6.18", "sm": 120}, torch.bfloat16, 8, None),
        ({"version": None}, torch.bfloat16, 2, "not installed"),
        ({"version": "0.9.1"}, torch.bfloat16, 2, "outside"),
        ({}, torch.float32, 2, "float32 activations"),
        ({}, torch.bfloat16, 1, "world size 1"),
        ({"version": "0.7.2", "sm": 80}, torch.bfloat16, 16, "world size 16"),
        ({"settings": FusionSettings(enabled=False)}, torch.bfloat16, 2, "FXFUSE_FUSION=off"),
    ],
)
def test_every_branch(machine, machine_args, dtype, world_size, reason_part):
    machine(**machine_args)
    reason = capability.fused_kernel_unavailable("cuda", dtype, world_size)
    assert reason is None if reason_part is None else reason_part in reason
    assert capability.fused_kernel_unavailable("cpu", dtype, world_size) is None


def block(x, residual, weight, group):
    return rmsnorm_transformers(funcol_all_reduce(x, group) + residual, weight, 1e-6)


@pytest.mark.parametrize("fuse_anyway", [False, True], ids=["left_to_inductor", "fused_anyway"])
def test_cuda_sites_without_a_kernel_stay_unfused_with_the_reason(machine, fuse_anyway):
    machine(version=None)  # no FlashInfer: no fused all-reduce kernel
    with fake_process_group(2) as group, FakeTensorMode(allow_non_fake_inputs=True):
        x, residual = torch.empty(4, 32, device="cuda", dtype=torch.bfloat16), torch.empty(4, 32, device="cuda", dtype=torch.bfloat16)
        weight = torch.empty(32, device="cuda", dtype=torch.bfloat16)
        backend = GraphKeepingBackend(inner="eager", fuse_without_fast_kernel=fuse_anyway)
        compile_and_run(block, x, residual, weight, group, backend=backend)
        stats = backend.records[-1].stats
        assert stats.fused == (1 if fuse_anyway else 0)
        assert stats.allreduces_after == (0 if fuse_anyway else 1)
        if not fuse_anyway:
            (node,) = backend.last_graph.find_nodes(op="call_function", target=ALL_REDUCE)
            assert "flashinfer-python is not installed" in explain_unfused(node, backend.config)


class GraphKeepingBackend(FxfuseBackend):
    """An FxfuseBackend that keeps the last graph it rewrote (to ask `explain_unfused` about it)."""

    def rewrite(self, graph):
        super().rewrite(graph)
        self.last_graph = graph
