"""CPU tests of the workspace registry: agreed creation/fallback over 2 gloo ranks, capture guard,
and that the CUDA path's modules never import FlashInfer on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fxfuse.runner.launch import run_on_ranks
from fxfuse.op.workspace import WorkspaceNotPrepared, WorkspaceRegistry, fingerprint, workspace_bytes


class FakeKernels:
    """Kernel library stand-in that records calls and fails where told to."""

    def __init__(self, fail_load_on=(), fail_create_on=(), rank=0):
        self.rank = rank
        self.fail_load_on, self.fail_create_on = fail_load_on, fail_create_on
        self.calls: list[str] = []

    def load(self):
        self.calls.append("load")
        if self.rank in self.fail_load_on:
            raise RuntimeError("no kernels here")

    def create_workspace(self, group, rank, world_size, max_tokens, hidden_size, dtype):
        self.calls.append(f"create {max_tokens}")
        dist.barrier(group=group)  # real creation is collective too
        if rank in self.fail_create_on:
            raise MemoryError("out of memory")  # e.g. initializing the exchanged buffers
        return f"handle-{rank}-{max_tokens}"

    def destroy_workspace(self, handle, group):
        self.calls.append(f"destroy {handle}")
        dist.barrier(group=group)

    def release_workspace(self, handle):
        self.calls.append(f"release {handle}")


def registry_scenarios(ctx):
    """On each rank: run the registry through success, failures and disagreement; report what happened."""
    rank, group = ctx.rank, ctx.group
    report = {}

    def registry(kernels, config=lambda *a: 7):
        return WorkspaceRegistry(lambda: kernels, config, device_for_buffers=lambda: torch.device("cpu"))

    ok = FakeKernels(rank=rank)
    reg = registry(ok)
    first = reg.prepare(group, 64, torch.bfloat16, max_tokens=8)
    again = reg.prepare(group, 64, torch.bfloat16, max_tokens=4)  # already big enough: kept
    bigger = reg.prepare(group, 64, torch.bfloat16, max_tokens=16)  # replaced
    from_call = reg.for_call(group.group_name, 64, torch.bfloat16, max_tokens=1)
    report["ok"] = dict(
        first=(first.handle, first.max_tokens, tuple(first.zero_residual.shape), first.zero_residual.abs().sum().item()),
        again_is_first=again is first,
        bigger=bigger.handle,
        call_uses_bigger=from_call is bigger,
        zero_slice=tuple(bigger.zero_residual_for(3).shape),
    )
    reg.destroy(group)
    report["ok"]["after_destroy"] = reg.lookup(group.group_name, 64, torch.bfloat16)
    report["ok"]["calls"] = ok.calls

    bad_load = FakeKernels(fail_load_on=(1,), rank=rank)
    reg = registry(bad_load)
    report["load_fails_on_1"] = dict(
        result=reg.prepare(group, 64, torch.bfloat16, 8),
        failure=reg.failure(group.group_name, 64, torch.bfloat16),
        retried=reg.for_call(group.group_name, 64, torch.bfloat16, 8),
        calls=bad_load.calls,
    )

    bad_create = FakeKernels(fail_create_on=(0,), rank=rank)
    reg = registry(bad_create)
    report["create_fails_on_0"] = dict(result=reg.prepare(group, 64, torch.bfloat16, 8),
                                       failure=reg.failure(group.group_name, 64, torch.bfloat16),
                                       calls=bad_create.calls)

    mismatch = FakeKernels(rank=rank)
    reg = registry(mismatch, config=lambda *a: 100 + rank)  # e.g. FXFUSE_FUSION differs between ranks
    report["settings_differ"] = dict(result=reg.prepare(group, 64, torch.bfloat16, 8),
                                     failure=reg.failure(group.group_name, 64, torch.bfloat16),
                                     calls=mismatch.calls)
    return report


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(registry_scenarios, 2, timeout_s=120)


@pytest.mark.slow
def test_agreed_creation_reuse_and_destroy(reports):
    for rank, report in enumerate(reports):
        ok = report["ok"]
        assert ok["first"] == (f"handle-{rank}-8", 8, (8, 64), 0.0)
        assert ok["again_is_first"] and ok["call_uses_bigger"]
        assert ok["bigger"] == f"handle-{rank}-16" and ok["zero_slice"] == (3, 64)
        assert ok["after_destroy"] is None
        assert ok["calls"] == ["load", "create 8", f"destroy handle-{rank}-8", "load", "create 16",
                               f"destroy handle-{rank}-16"]


@pytest.mark.slow
def test_load_failure_on_one_rank_makes_all_fall_back(reports):
    for rank, report in enumerate(reports):
        r = report["load_fails_on_1"]
        assert r["result"] is None and r["retried"] is None
        assert r["calls"] == ["load"]  # nobody entered the collective creation
        expected = "no kernels here" if rank == 1 else "another rank could not load"
        assert expected in r["failure"]


@pytest.mark.slow
def test_creation_failure_on_one_rank_makes_all_fall_back(reports):
    r0, r1 = (report["create_fails_on_0"] for report in reports)
    assert r0["result"] is None and r1["result"] is None
    assert "MemoryError: out of memory" in r0["failure"]
    assert "failed on another rank" in r1["failure"]
    assert r0["calls"] == ["load", "create 8"]
    assert r1["calls"] == ["load", "create 8", "release handle-1-8"]  # the survivor frees its part locally


@pytest.mark.slow
def test_differing_settings_make_all_fall_back(reports):
    for report in reports:
        r = report["settings_differ"]
        assert r["result"] is None and "settings differ" in r["failure"]
        assert r["calls"] == ["load"]


def test_first_call_during_capture_says_what_to_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    reg = WorkspaceRegistry(lambda: FakeKernels())
    with pytest.raises(WorkspaceNotPrepared, match=r"fxfuse\.prepare\(group, hidden_size=7168"):
        reg.for_call("some-group", 7168, torch.bfloat16, max_tokens=64)


def test_workspace_bytes_and_fingerprint():
    # tp=8, 512 tokens, hidden 7168: 4 buffers of 8*512*7168 bf16 + 3*2 MiB flags + zero residual.
    assert workspace_bytes(8, 512, 7168, torch.bfloat16) == 4 * 8 * 512 * 7168 * 2 + 6 * 2**20 + 512 * 7168 * 2
    assert fingerprint("H200", 90, 7168) == fingerprint("H200", 90, 7168) != fingerprint("H200", 90, 4096)


@pytest.mark.slow
def test_cpu_paths_never_import_flashinfer():
    code = (
        "import sys, torch, fxfuse\n"
        "import fxfuse.op.fused_path as ff, fxfuse.op.trtllm_kernels, fxfuse.op.workspace, fxfuse.bench.kernel\n"
        "assert fxfuse.prepare is ff.prepare and fxfuse.destroy_workspaces is ff.destroy_workspaces\n"
        "w = torch.ones(8)\n"
        "assert ff.try_allreduce_residual_rmsnorm(torch.ones(2, 8), None, w, 1e-6, 'g') is None\n"
        "assert ff.fusion_stats()['fallback']\n"
        "assert not [m for m in sys.modules if m.startswith('flashinfer')], 'flashinfer imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
