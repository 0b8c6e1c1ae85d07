"""CPU tests of the CUDA path's lifecycle and rank agreement, over 2 gloo ranks with fake kernels:
agreed workspace creation and fallback, growth that keeps the old workspace for captured graphs,
destroy refusing to free captured workspaces, a bounded exit, shared IPC buffers that never leak or
hang when one rank fails, and the once-per-group exchange of settings and topology."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from fault_fakes import FakeRuntime

from fxfuse.op.decide.agreement import ConfigMismatch, fingerprint
from fxfuse.op.decide.flashinfer_version import features
from fxfuse.op.decide.group_config import LocalReport, combine_reports
from fxfuse.op.decide.settings import FusionSettings
from fxfuse.op.decide.thresholds import ThresholdTable
from fxfuse.op.decide.topology import LocalView, Topology, combine_views
from fxfuse.op.runtime.cuda_ipc import SharedBufferError, close_shared_buffers, create_shared_buffers
from fxfuse.op.runtime.workspace import WorkspaceNotPrepared, WorkspaceRegistry, workspace_bytes
from fxfuse.runner.launch import run_on_ranks


class FakeKernels:
    """Kernel library stand-in that records calls and fails where told to."""

    def __init__(self, rank, fail_load_on=(), fail_create_on=()):
        self.rank, self.fail_load_on, self.fail_create_on = rank, fail_load_on, fail_create_on
        self.calls: list[str] = []

    def load(self):
        self.calls.append("load")
        if self.rank in self.fail_load_on:
            raise RuntimeError("no kernels here")

    def create(self, group, max_tokens):
        self.calls.append(f"create {max_tokens}")
        dist.barrier(group=group)  # real creation is collective too
        if self.rank in self.fail_create_on:
            raise MemoryError("out of memory")
        return f"handle-{self.rank}-{max_tokens}"

    def destroy_workspace(self, handle, group):
        self.calls.append(f"destroy {handle}")
        dist.barrier(group=group)

    def release_workspace(self, handle):
        self.calls.append(f"release {handle}")


def registry_for(kernels, idle=True):
    return WorkspaceRegistry("fake", lambda: kernels, lambda *a: 0, streams_idle=lambda streams, timeout: idle)


def registry_scenarios(ctx):
    """On each rank: run the registry through success, growth, capture, failures; report what happened."""
    rank, group = ctx.rank, ctx.group
    report = {}

    ok = FakeKernels(rank)
    reg = registry_for(ok)

    def ensure(tokens, kernels=ok, registry=None):
        return (registry or reg).ensure(group, 64, torch.bfloat16, tokens, lambda k: kernels.create(group, tokens))

    first = ensure(8)
    again = ensure(4)  # already big enough: kept
    bigger = ensure(16)  # a new one; the first is retired, not freed
    report["ok"] = dict(first=first.handle, again_is_first=again is first, bigger=bigger.handle,
                        retired=[w.handle for w in reg.retired()], lookup_is_bigger=reg.lookup(group.group_name, 64, torch.bfloat16) is bigger)
    first.captured = True  # as note_use records when a call happens during CUDA-graph capture
    try:
        reg.check_destroyable(group.group_name, graphs_released=False)
        report["ok"]["destroy_refused"] = False
    except RuntimeError as exc:
        report["ok"]["destroy_refused"] = "graphs_released=True" in str(exc)
    report["ok"]["nothing_freed_by_refusal"] = not any(c.startswith("destroy") for c in ok.calls)
    reg.check_destroyable(group.group_name, graphs_released=True)
    reg.destroy(group)
    report["ok"]["after_destroy"] = (reg.lookup(group.group_name, 64, torch.bfloat16), reg.retired())
    report["ok"]["calls"] = ok.calls

    bad_load = FakeKernels(rank, fail_load_on=(1,))
    reg2 = registry_for(bad_load)
    report["load_fails_on_1"] = dict(result=ensure(8, bad_load, reg2), failure=reg2.failure(group.group_name, 64, torch.bfloat16),
                                     retried=ensure(8, bad_load, reg2), calls=bad_load.calls)

    bad_create = FakeKernels(rank, fail_create_on=(0,))
    reg3 = registry_for(bad_create)
    report["create_fails_on_0"] = dict(result=ensure(8, bad_create, reg3), failure=reg3.failure(group.group_name, 64, torch.bfloat16),
                                       calls=bad_create.calls)

    asks_differ = FakeKernels(rank)
    reg4 = registry_for(asks_differ)
    report["requests_differ"] = dict(result=ensure(8 + rank, asks_differ, reg4), calls=asks_differ.calls,
                                     failure=reg4.failure(group.group_name, 64, torch.bfloat16))

    busy = FakeKernels(rank)
    reg5 = registry_for(busy, idle=False)
    ensure(8, busy, reg5)
    dist.destroy_process_group()  # at exit the group may be gone: release_all must not need it
    reg5.release_all(wait_s=0.01)
    report["exit_busy_gpu"] = dict(calls=busy.calls, left=reg5.lookup("x", 64, torch.bfloat16))
    reg.release_all()
    return report


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(registry_scenarios, 2, timeout_s=120)


@pytest.mark.slow
def test_agreed_creation_growth_keeps_old_and_destroy_frees_both(reports):
    for rank, report in enumerate(reports):
        ok = report["ok"]
        assert ok["first"] == f"handle-{rank}-8" and ok["again_is_first"] and ok["lookup_is_bigger"]
        assert ok["bigger"] == f"handle-{rank}-16" and ok["retired"] == [f"handle-{rank}-8"]
        assert ok["destroy_refused"] and ok["nothing_freed_by_refusal"]
        assert ok["after_destroy"] == (None, [])
        assert ok["calls"] == ["load", "create 8", "load", "create 16",
                               f"destroy handle-{rank}-8", f"destroy handle-{rank}-16"]


@pytest.mark.slow
def test_load_failure_on_one_rank_makes_all_fall_back(reports):
    for report in reports:
        r = report["load_fails_on_1"]
        assert r["result"] is None and r["retried"] is None
        assert r["calls"] == ["load"]  # nobody created anything, nobody retried
    # every rank records the same reason, naming the rank and the step that failed
    assert reports[0]["load_fails_on_1"]["failure"] == reports[1]["load_fails_on_1"]["failure"] == (
        "rank 1, loading the kernels (FlashInfer import and JIT): RuntimeError: no kernels here")


@pytest.mark.slow
def test_creation_failure_on_one_rank_makes_all_fall_back(reports):
    for rank, report in enumerate(reports):
        r = report["create_fails_on_0"]
        assert r["result"] is None
        released = [f"release handle-{rank}-8"] if rank == 1 else []  # the rank that succeeded frees its part locally
        assert r["calls"] == ["load", "create 8", *released]
    assert reports[0]["create_fails_on_0"]["failure"] == reports[1]["create_fails_on_0"]["failure"] == (
        "rank 0, creating the workspace: MemoryError: out of memory")


@pytest.mark.slow
def test_ranks_asking_for_different_workspaces_all_fall_back(reports):
    for report in reports:
        r = report["requests_differ"]
        assert r["result"] is None and r["calls"] == ["load"] and "the ranks asked for different things" in r["failure"]
    assert "rank 0=('fake', 64, 'torch.bfloat16', 8), rank 1=('fake', 64, 'torch.bfloat16', 9)" in reports[0]["requests_differ"]["failure"]


@pytest.mark.slow
def test_exit_with_a_busy_gpu_returns_without_peers_or_hanging(reports):
    for report in reports:
        assert report["exit_busy_gpu"]["calls"] == ["load", "create 8"]  # nothing released, nothing waited on
        assert report["exit_busy_gpu"]["left"] is None


def test_exit_with_an_idle_gpu_releases_locally(monkeypatch):
    kernels = FakeKernels(0)
    reg = registry_for(kernels)
    from fxfuse.op.runtime.workspace import FusionWorkspace

    reg._ready[("g", 64, torch.bfloat16)] = FusionWorkspace(("g", 64, torch.bfloat16), 8, "h")
    reg.release_all()
    assert kernels.calls == ["release h"] and reg.lookup("g", 64, torch.bfloat16) is None


def test_first_call_during_capture_says_what_to_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    group = type("G", (), {"group_name": "some-group"})()
    with pytest.raises(WorkspaceNotPrepared, match=r"fxfuse\.prepare\(group, hidden_size=7168"):
        registry_for(FakeKernels(0)).ensure(group, 7168, torch.bfloat16, 64, lambda k: None)


def test_workspace_bytes_is_what_the_layout_allocates():
    # tp=8, 512 tokens, hidden 7168: a two-shot buffer and three Lamport buffers of 8*512*7168 bf16 (each a
    # multiple of 2 MiB), 8*256 int32 flags rounded up to 2 MiB, and the zero residual.
    comm = 8 * 512 * 7168 * 2
    assert workspace_bytes(8, 512, 7168, torch.bfloat16) == comm + 3 * comm + 2**21 + 512 * 7168 * 2
    assert fingerprint("H200", 90, 7168) == fingerprint("H200", 90, 7168) != fingerprint("H200", 90, 4096)
    with pytest.raises(ValueError, match="32-bit offsets"):
        workspace_bytes(8, 9363, 7168, torch.bfloat16)


# ---------------------------------------------------------------- shared IPC buffers (fake CUDA runtime)


def shared_buffer_scenarios(ctx):
    group, rank, out = ctx.group, ctx.rank, {}
    runtime = FakeRuntime(rank)
    buffers = create_shared_buffers([64, 128], group, runtime, device_index=0)
    out["pointers"] = [b.pointers for b in buffers]
    out["live_mapped"] = (len(runtime.live), len(runtime.mapped))
    close_shared_buffers(buffers, group, runtime)
    out["after_close"] = (len(runtime.live), len(runtime.mapped), [b.closed for b in buffers])
    close_shared_buffers(buffers, None, runtime)  # a second close (e.g. at exit) does nothing
    for what, bad_rank in (("malloc", 1), ("open", 0)):
        runtime = FakeRuntime(rank, {what: bad_rank})
        try:
            create_shared_buffers([64, 128], group, runtime, device_index=0)
            out[what] = "no error"
        except SharedBufferError as exc:
            out[what] = (str(exc), len(runtime.live), len(runtime.mapped))
    return out


@pytest.mark.slow
def test_shared_buffers_map_every_peer_and_close_cleanly():
    results = run_on_ranks(shared_buffer_scenarios, 2, timeout_s=120)
    for rank, out in enumerate(results):
        own = [p[rank] for p in out["pointers"]]
        assert out["live_mapped"] == (2, 2) and len(set(own)) == 2
        assert out["after_close"] == (0, 0, [True, True])
    # peer views are the peer's own pointers, mapped (+1 in the fake): every rank sees the same buffers
    for i in range(2):
        assert results[0]["pointers"][i][1] == results[1]["pointers"][i][1] + 1
        assert results[1]["pointers"][i][0] == results[0]["pointers"][i][0] + 1


@pytest.mark.slow
@pytest.mark.parametrize("what, bad_rank", [("malloc", 1), ("open", 0)])
def test_shared_buffer_failure_on_one_rank_raises_everywhere_and_leaks_nothing(what, bad_rank):
    for out in run_on_ranks(shared_buffer_scenarios, 2, timeout_s=120):
        message, live, mapped = out[what]
        assert f"rank {bad_rank}, " in message and f"RuntimeError: {what} failed on rank {bad_rank}" in message
        assert (live, mapped) == (0, 0)


# ---------------------------------------------------------------- settings and topology agreement


def view(uuid, links, host="h"):
    return LocalView(host, uuid, tuple(links.items()), "test")


def test_topology_is_the_worst_link_any_rank_sees():
    sw = Topology.NVSWITCH
    four = [view(g, {p: sw for p in "abcd" if p != g}) for g in "abcd"]
    assert combine_views(four)[0] is Topology.NVSWITCH
    # one rank sees its link to d as PCIe only: everyone takes PCIe
    four[1] = view("b", {"a": sw, "c": sw, "d": Topology.PCIE})
    topology, why = combine_views(four)
    assert topology is Topology.PCIE and "b -> d" in why
    # a peer the probe could not see counts as no link
    assert combine_views([view("a", {}), view("b", {"a": sw})])[0] is Topology.NONE
    assert combine_views([view("a", {"b": sw}), view("b", {"a": sw}, host="other")])[0] is Topology.NONE
    assert combine_views([view("a", {}), view("a", {})]) == (Topology.NONE, "several ranks share one GPU")
    assert combine_views([view("a", {})])[0] is Topology.NONE


def report(settings="s", links=None, gpu="NVIDIA H200", tune=""):
    return LocalReport(gpu=gpu, sm=90, flashinfer_version="0.7.2", settings=settings, thresholds_digest="t",
                       pcie_tune_digest=tune, view=view("a" if links is None else links[0], {} if links is None else links[1]))


def test_group_config_is_agreed_or_the_same_error_everywhere():
    settings, table, fi = FusionSettings(), ThresholdTable(), features("0.7.2")
    links = [("a", {"b": Topology.PCIE}), ("b", {"a": Topology.PCIE})]
    config = combine_reports([report(links=links[0]), report(links=links[1])], "g", settings, table, fi)
    assert config.topology is Topology.PCIE and config.world_size == 2 and config.gpu == "NVIDIA H200"
    forced = combine_reports([report(links=links[0]), report(links=links[1])], "g",
                             FusionSettings(topology=Topology.NVSWITCH), table, fi)
    assert forced.topology is Topology.NVSWITCH and "FXFUSE_TOPOLOGY" in forced.topology_reason
    for field, values in (("settings", ("s", "other")), ("gpu", ("NVIDIA H200", "NVIDIA H100")),
                          ("tune", ("/t:ab", "/t:absent"))):
        reports = [report(**{field: values[0]}, links=links[0]), report(**{field: values[1]}, links=links[1])]
        with pytest.raises(ConfigMismatch, match="rank 0=.*rank 1=") as info:
            combine_reports(reports, "g", settings, table, fi)
        assert "same FXFUSE_* settings" in str(info.value)


def group_config_on_rank(ctx):
    """Each rank sends a report with its own settings; all gather and combine."""
    from fxfuse.op.decide.agreement import gather_objects

    mine = report(settings="auto" if ctx.rank == 0 else "FXFUSE_FUSION=off", links=(f"g{ctx.rank}", {}))
    try:
        combine_reports(gather_objects(mine, ctx.group), ctx.group.group_name, FusionSettings(), ThresholdTable(), features("0.7.2"))
        return "agreed"
    except ConfigMismatch as exc:
        return str(exc)


@pytest.mark.slow
def test_differing_settings_raise_the_same_error_on_every_rank():
    messages = run_on_ranks(group_config_on_rank, 2, timeout_s=120)
    assert messages[0] == messages[1] and "FXFUSE_FUSION=off" in messages[0]


def test_cpu_paths_never_import_flashinfer():
    code = (
        "import sys, torch, fxfuse\n"
        "import fxfuse.op.runtime.prepare as p, fxfuse.op.runtime.trtllm_kernels, fxfuse.op.runtime.pcie_kernels, fxfuse.op.runtime.workspace\n"
        "import fxfuse.op.runtime.cuda_dispatch, fxfuse.op.decide.capability, fxfuse.bench.kernel\n"
        "assert fxfuse.prepare is p.prepare and fxfuse.destroy_workspaces is p.destroy_workspaces\n"
        "assert fxfuse.op.decide.capability.fused_kernel_unavailable('cpu', torch.bfloat16, 2) is None\n"
        "assert not [m for m in sys.modules if m.startswith('flashinfer')], 'flashinfer imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _rank_1_hangs(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.rank


@pytest.mark.slow
def test_a_hung_rank_is_named_and_stopped():
    from fxfuse.runner.launch import RankFailed

    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank\(s\) \[1\] did not finish within 10 s") as info:
        run_on_ranks(_rank_1_hangs, 2, timeout_s=10)
    assert info.value.rank == 1 and time.monotonic() - start < 60
