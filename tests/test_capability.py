"""Compile-time capability (issue 21, item 3): whether a CUDA site becomes the fused op depends on the
graph alone (dtype, world size), never on a rank's environment (FXFUSE_FUSION, the installed
FlashInfer, the GPU), so every rank issues the same collectives; sites no fused kernel takes are left
to Inductor with the reason in `explain_unfused`, unless the backend is told to fuse them anyway; CPU
sites are always fused (the reference kernel). Compiles run on fake CUDA tensors (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from toy_graphs import compile_and_run, fake_process_group, funcol_all_reduce, rmsnorm_transformers

from fxfuse.backend import FxfuseBackend
from fxfuse.op.decide import capability, flashinfer_version
from fxfuse.op.decide.settings import current_settings
from fxfuse.passes.pattern_support import ALL_REDUCE
from fxfuse.passes.unfused_reasons import explain_unfused


@pytest.mark.parametrize(
    "dtype, world_size, reason_part",
    [
        (torch.bfloat16, 2, None),
        (torch.float16, 16, None),  # TRT-LLM runs 16 ranks
        (torch.bfloat16, 8, None),
        (torch.float32, 2, "float32 activations"),
        (torch.bfloat16, 1, "world size 1"),
        (torch.bfloat16, 3, "world size 3"),
    ],
)
def test_only_graph_facts_decide(dtype, world_size, reason_part):
    reason = capability.fused_kernel_unavailable("cuda", dtype, world_size)
    assert reason is None if reason_part is None else reason_part in reason
    assert capability.fused_kernel_unavailable("cpu", dtype, world_size) is None


def block(x, residual, weight, group):
    return rmsnorm_transformers(funcol_all_reduce(x, group) + residual, weight, 1e-6)


def _compile_on_fake_cuda(dtype=torch.bfloat16, fuse_anyway=False):
    """Compile `block` on fake CUDA tensors and a fake 2-rank group; the backend, and the reason
    `explain_unfused` gives for the all-reduce left in the graph (None if it was fused)."""
    with fake_process_group(2) as group, FakeTensorMode(allow_non_fake_inputs=True):
        x, residual = torch.empty(4, 32, device="cuda", dtype=dtype), torch.empty(4, 32, device="cuda", dtype=dtype)
        weight = torch.empty(32, device="cuda", dtype=dtype)
        backend = GraphKeepingBackend(inner="eager", fuse_without_fast_kernel=fuse_anyway)
        compile_and_run(block, x, residual, weight, group, backend=backend)
        left = backend.last_graph.find_nodes(op="call_function", target=ALL_REDUCE)
        return backend, (explain_unfused(left[0], backend.config) if left else None)


@pytest.mark.parametrize("environment", ["FXFUSE_FUSION=off", "FXFUSE_FUSION=bogus", "no FlashInfer", "FlashInfer 0.9"])
def test_a_ranks_environment_never_changes_its_graph(monkeypatch, environment):
    """Before, a rank with FXFUSE_FUSION=off or without FlashInfer kept Inductor's all-reduce while its
    peers called the op (mismatched collectives), and a bad setting crashed that rank's compile."""
    reference, _ = _compile_on_fake_cuda()
    assert reference.records[-1].stats.fused == 1
    if environment.startswith("FXFUSE_FUSION"):
        monkeypatch.setenv("FXFUSE_FUSION", environment.split("=")[1])
        current_settings.cache_clear()
    else:
        version = None if environment == "no FlashInfer" else "0.9.0"
        monkeypatch.setattr(flashinfer_version, "installed_version", lambda: version)
    try:
        changed, _ = _compile_on_fake_cuda()
    finally:
        current_settings.cache_clear()
    assert changed.records[-1].stats == reference.records[-1].stats
    assert changed.records[-1].after.text() == reference.records[-1].after.text()


@pytest.mark.parametrize("fuse_anyway", [False, True], ids=["left_to_inductor", "fused_anyway"])
def test_cuda_sites_no_fused_kernel_takes_stay_unfused_with_the_reason(fuse_anyway):
    backend, reason = _compile_on_fake_cuda(torch.float32, fuse_anyway)
    stats = backend.records[-1].stats
    assert stats.fused == (1 if fuse_anyway else 0)
    assert stats.allreduces_after == (0 if fuse_anyway else 1)
    assert (reason is None) if fuse_anyway else ("float32 activations" in reason)


class GraphKeepingBackend(FxfuseBackend):
    """An FxfuseBackend that keeps the last graph it rewrote (to ask `explain_unfused` about it)."""

    def rewrite(self, graph):
        super().rewrite(graph)
        self.last_graph = graph
