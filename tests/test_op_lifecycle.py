"""The fused op's state over its life (issue 21, items 4-8): `destroy_workspaces` frees all or nothing
and always drops the plans; a process-group name torch reuses gets a fresh agreement, plans and
workspaces; exit waits on every stream a workspace ran on and never frees what a capture used; the C++
fallback builds without a home directory and rebuilds a corrupt cache; arguments that do not fit are
one clear error on every path, and rows wider than the Triton kernel still get the right values.
CUDA parts are fakes (tests/fault_fakes.py); tests/gpu/test_fallback_gpu.py covers the real streams."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from fault_fakes import FakeTrtllmKernels, patched
from test_fault_matrix import HIDDEN, _fake_machine

from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.runtime.workspace import FusionWorkspace, WorkspaceRegistry
from fxfuse.runner.launch import run_on_ranks


def _first_call(group, rank):
    """One fused call on `group` (fp16 CPU tensors); returns (normed, residual_out)."""
    from fxfuse.op.runtime import cuda_dispatch

    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(rank)).half()
    return cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, None, torch.ones(HIDDEN).half(), 1e-6, group.group_name)


# ---------------------------------------------------------------- item 4: destroy frees all or nothing


def _destroy_on_rank(ctx, captured_on: tuple[int, ...]):
    """A TensorRT-LLM workspace made by a first call; a PCIe one marked captured on `captured_on` ranks;
    then destroy (refused), destroy with graphs_released (frees both)."""
    import fxfuse
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.workspace import PCIE

    group = dist.new_group(list(range(ctx.world_size)))
    kernels = FakeTrtllmKernels(ctx.rank)
    pcie_kernels = FakeTrtllmKernels(ctx.rank)
    out = {}
    with patched(*_fake_machine(ctx.rank, ctx.world_size, kernels), (PCIE, "_kernels", pcie_kernels)):
        _first_call(group, ctx.rank)
        pcie = pcie_kernels.create_workspace(group, ctx.rank, ctx.world_size, 4, HIDDEN, torch.float16)
        key = (group.group_name, HIDDEN, torch.float16)
        PCIE._ready[key] = FusionWorkspace(key, 4, pcie, captured=ctx.rank in captured_on)
        try:
            fxfuse.destroy_workspaces(group)
            out["refused"] = None
        except RuntimeError as exc:
            out["refused"] = str(exc)
        out["freed_after_refusal"] = [w.freed for w in kernels.workspaces + [pcie]]
        out["plans_after_refusal"] = [k for k in cuda_dispatch._PLANS if k[0] == group.group_name]
        fxfuse.destroy_workspaces(group, graphs_released=True)
        out["freed_after_release"] = [w.freed for w in kernels.workspaces + [pcie]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("captured_on", [(0, 1), (1,)], ids=["captured_everywhere", "captured_on_rank_1_only"])
def test_destroy_refuses_on_every_rank_frees_nothing_and_drops_plans(captured_on):
    results = run_on_ranks(_destroy_on_rank, 2, captured_on, timeout_s=300)
    assert results[0]["refused"] == results[1]["refused"]
    named = "ranks 0, 1" if captured_on == (0, 1) else "rank 1"
    assert f"freed nothing of process group '1': {named}, checking the PCIe workspaces" in results[0]["refused"]
    for out in results:
        assert out["freed_after_refusal"] == [False, False]  # before: the TensorRT-LLM one was freed, then it raised
        assert out["plans_after_refusal"] == []  # before: the plan kept launching on the freed workspace
        assert out["freed_after_release"] == [True, True]


# ---------------------------------------------------------------- item 5: a reused group name


def _reuse_on_rank(ctx, store: str):
    """Group "1" spans both ranks and gets a TensorRT-LLM plan; every group is destroyed; the re-created
    "1" holds rank 0 alone. Rank 0's next call must see a one-rank group, not the old plan."""
    from fxfuse.op.decide.group_config import config_of
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.workspace import TRTLLM

    out = {}
    kernels = FakeTrtllmKernels(ctx.rank)
    with patched(*_fake_machine(ctx.rank, ctx.world_size, kernels)):
        old = dist.new_group([0, 1])
        out["old"] = (old.group_name, type(_plan_after_call(old, ctx.rank)).__name__)
        old_workspace = kernels.workspaces[0]
        new = _recreate_groups(ctx, store)
        if ctx.rank == 0:
            x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3)).half()
            normed, residual_out = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, None, torch.ones(HIDDEN).half(), 1e-6,
                                                                                 new.group_name)
            plan = cuda_dispatch._PLANS[cuda_dispatch.plan_key(new.group_name, x, None, torch.ones(HIDDEN).half())]
            out["new"] = (new.group_name, type(plan).__name__, plan.decision.reason, config_of(new).world_size)
            out["values"] = (x, normed, residual_out)
            out["old_workspace_retired"] = old_workspace in [w.handle for w in TRTLLM.retired()]
    return out


def _recreate_groups(ctx, store: str):
    """Destroy every group, re-initialize the world (file store) and make a one-rank group [0]: on
    rank 0 it gets the name "1" again, which a two-rank group had before. The barrier keeps rank 1, which has
    nothing more to do, from ending while rank 0 still connects to it (gloo: "Connection closed by peer")."""
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=ctx.rank, world_size=ctx.world_size)
    dist.barrier()
    return dist.new_group([0])


def _plan_after_call(group, rank):
    from fxfuse.op.runtime import cuda_dispatch

    _first_call(group, rank)
    like = torch.empty(2, HIDDEN, dtype=torch.float16)
    return cuda_dispatch._PLANS[cuda_dispatch.plan_key(group.group_name, like, None, like[0])]


@pytest.mark.slow
def test_a_reused_group_name_is_agreed_and_planned_afresh(tmp_path):
    out = run_on_ranks(_reuse_on_rank, 2, str(tmp_path / "store"), timeout_s=300)[0]
    assert out["old"] == ("1", "TrtllmPlan")
    name, plan, reason, world_size = out["new"]
    assert name == "1" and plan == "NcclPlan" and world_size == 1 and "one-rank group" in reason
    x, normed, residual_out = out["values"]
    torch.testing.assert_close((normed, residual_out), add_rmsnorm(x, None, torch.ones(HIDDEN).half(), 1e-6),
                               rtol=1e-3, atol=1e-3)  # a one-rank sum: x itself, not a sum over the old group
    assert out["old_workspace_retired"]  # kept alive (a graph may have captured it), never handed out again


def _reuse_in_cpp_on_rank(ctx, store: str, native_cache: str):
    """The C++ fallback registered the two-rank group "1"'s shape (an NCCL plan: FXFUSE_FUSION=off);
    after "1" is re-created for rank 0 alone, the registration must not serve it."""
    os.environ["FXFUSE_NATIVE_CACHE"] = native_cache
    os.environ["FXFUSE_FUSION"] = "off"
    from fxfuse.op.kernels.native_fallback import calls_by_reason
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.registration import install_native_fallback

    assert install_native_fallback()
    old = dist.new_group([0, 1])
    _first_call(old, ctx.rank)  # decided in Python: an NCCL plan, registered with C++
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3)).half()
    torch.ops.fxfuse_native.run(x, None, torch.ones(HIDDEN).half(), 1e-6, old.group_name, False)
    out = {"cpp_calls_old_group": sum(calls_by_reason().values())}
    new = _recreate_groups(ctx, store)
    if ctx.rank == 0:
        normed, residual_out = torch.ops.fxfuse_native.run(x, None, torch.ones(HIDDEN).half(), 1e-6, new.group_name, False)
        out["cpp_calls_after"] = sum(calls_by_reason().values())
        out["values"] = (x, normed, residual_out)
    return out


@pytest.mark.slow
def test_the_cpp_fallback_drops_a_shape_registered_for_the_old_group(tmp_path, native_library):
    out = run_on_ranks(_reuse_in_cpp_on_rank, 2, str(tmp_path / "store"), native_library, timeout_s=300)[0]
    assert out["cpp_calls_old_group"] == 1 and out["cpp_calls_after"] == 1  # the old registration served the old group only
    x, normed, residual_out = out["values"]
    torch.testing.assert_close((normed, residual_out), add_rmsnorm(x, None, torch.ones(HIDDEN).half(), 1e-6))


# ---------------------------------------------------------------- item 6: exit waits on every stream


def test_exit_waits_on_every_stream_a_workspace_ran_on_and_leaves_captured_ones():
    seen, released = [], []

    class Kernels:
        def release_workspace(self, handle):
            released.append(handle)

    def idle(streams, timeout_s):
        seen.append(set(streams))
        return True

    registry = WorkspaceRegistry("fake", Kernels, lambda *a: 0, streams_idle=idle)
    registry._ready[("g", 64, torch.bfloat16)] = FusionWorkspace(("g", 64, torch.bfloat16), 8, "on s1 and s2", streams={"s1", "s2"})
    registry._ready[("g", 128, torch.bfloat16)] = FusionWorkspace(("g", 128, torch.bfloat16), 8, "captured", captured=True)
    registry._retired.append(FusionWorkspace(("g", 64, torch.bfloat16), 4, "retired on s3", streams={"s3"}))
    registry.release_all()
    assert seen == [{"s1", "s2", "s3"}]  # every stream a call ran on, not just the current one
    assert sorted(released) == ["on s1 and s2", "retired on s3"]  # a captured one is left to process teardown
    assert registry.lookup("g", 64, torch.bfloat16) is None and registry.retired() == []


def test_exit_with_a_busy_stream_frees_nothing(capsys):
    released = []
    registry = WorkspaceRegistry("fake", lambda: type("K", (), {"release_workspace": lambda self, h: released.append(h)})(),
                                 lambda *a: 0, streams_idle=lambda streams, timeout_s: False)
    registry._ready[("g", 64, torch.bfloat16)] = FusionWorkspace(("g", 64, torch.bfloat16), 8, "busy", streams={"s"})
    registry.release_all(wait_s=0.01)
    assert released == [] and "leaving 1 fake workspace(s) to process teardown" in capsys.readouterr().err


# ---------------------------------------------------------------- item 7: the native build


def test_the_native_cache_needs_no_home_directory(monkeypatch):
    from fxfuse.op.kernels import native_build

    monkeypatch.delenv("FXFUSE_NATIVE_CACHE", raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no $HOME and no passwd entry
    folder = native_build.cache_dir()
    assert folder.is_absolute() and folder.name == f"fxfuse-native-{os.getuid()}"


@pytest.mark.slow
def test_a_corrupt_cached_library_is_rebuilt(tmp_path):
    """A truncated .so in the cache (a full disk, a killed copy) made every later process fall back to
    the Python kernel for good; now it is rebuilt once, in a fresh process."""
    import subprocess
    import sys

    from fxfuse.op.kernels.native_build import compiler, library_path

    if compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    env = {**os.environ, "FXFUSE_NATIVE_CACHE": str(tmp_path)}
    code = ("from fxfuse.op.kernels.native_build import load_native_library, library_path, compiler\n"
            "print(load_native_library() == library_path(compiler()))\n")
    os.environ["FXFUSE_NATIVE_CACHE"] = str(tmp_path)
    try:
        target = library_path(compiler())
    finally:
        del os.environ["FXFUSE_NATIVE_CACHE"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"\x7fELF truncated")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert "does not load" in done.stderr and target.stat().st_size > 100_000


# ---------------------------------------------------------------- item 8: arguments that do not fit


@pytest.mark.parametrize("residual_dtype, weight_dtype, weight_shape, match", [
    (torch.float16, torch.bfloat16, (8,), "residual dtype torch.float16 must be x's torch.bfloat16 or float32"),
    (torch.float32, torch.bfloat16, (8,), "a float32 residual with torch.bfloat16 x needs the weight applied in float32"),
    (torch.bfloat16, torch.float32, (8,), "weight dtype torch.float32 must be x's torch.bfloat16"),
    (torch.bfloat16, torch.bfloat16, (1, 8), r"weight \[1, 8\] must be \[hidden\] = \[8\]"),
])
def test_arguments_that_do_not_fit_are_refused_by_the_cpu_and_fake_kernels(residual_dtype, weight_dtype, weight_shape, match):
    """A direct call with a float32 residual returned float32 on CPU where the fake kernel said bfloat16;
    a [1, H] weight was taken by the C++ path. Now every kernel refuses them with one message."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from toy_graphs import fake_process_group

    from fxfuse.op.schema import allreduce_residual_rmsnorm

    with fake_process_group() as group:
        args = (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=residual_dtype),
                torch.randn(weight_shape, dtype=weight_dtype), 1e-6, group.group_name)
        with pytest.raises(ValueError, match=match):
            allreduce_residual_rmsnorm(*args)
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=match):
            allreduce_residual_rmsnorm(*args)


def test_rows_wider_than_the_triton_kernel_get_the_reference_values():
    """hidden > 65536 raised inside the norm after a donated x was already all-reduced in place."""
    from fxfuse.op.kernels.add_rmsnorm_kernel import MAX_HIDDEN, add_rmsnorm_into

    reduced, residual = torch.randn(2, MAX_HIDDEN + 16), torch.randn(2, MAX_HIDDEN + 16)
    weight = torch.randn(MAX_HIDDEN + 16)
    expected = add_rmsnorm(reduced, residual, weight, 1e-6)
    normed = torch.empty_like(reduced)
    add_rmsnorm_into(reduced, residual, weight, 1e-6, reduced, normed)  # residual_out in reduced's memory
    torch.testing.assert_close((normed, reduced), expected, rtol=0, atol=0)


def _cpp_refuses_on_rank(ctx, native_cache: str):
    os.environ["FXFUSE_NATIVE_CACHE"] = native_cache
    from nccl_plan_helpers import use_nccl_plans

    import fxfuse.op.runtime.registration  # noqa: F401 - defines the ops the C++ path calls back into
    from fxfuse.op.kernels.native_build import load_native_library
    from fxfuse.op.runtime import cuda_dispatch

    assert load_native_library() is not None
    name = use_nccl_plans(ctx)
    x, weight = torch.randn(4, 8), torch.ones(8)
    cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, None, weight, 1e-6, name)  # the shape is registered with C++
    try:
        torch.ops.fxfuse_native.run(x, None, weight.view(1, 8), 1e-6, name, False)
        return "accepted"
    except (ValueError, RuntimeError) as exc:
        return str(exc)


@pytest.mark.slow
def test_the_cpp_fallback_hands_a_misshapen_weight_to_python_which_refuses_it(native_library):
    for message in run_on_ranks(_cpp_refuses_on_rank, 2, native_library, timeout_s=300):
        assert "weight [1, 8] must be [hidden] = [8]" in message


# ---------------------------------------------------------------- issue 41: prepare() as a Python user calls it


def test_prepare_on_a_machine_without_cuda_returns_false():
    """The CPU kernel has nothing to prepare: False at once (it used to die in Triton: "0 active drivers")."""
    import fxfuse
    from toy_graphs import fake_process_group

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: prepare() makes workspaces there (tests/gpu)")
    with fake_process_group() as group:
        assert fxfuse.prepare(group, 64, torch.bfloat16, 16) is False


@pytest.mark.parametrize("arguments, error, message", [
    ((None, -1, torch.bfloat16), ValueError, "hidden_size must be a positive int (the model's hidden size), got -1"),
    ((None, 64, "bf16"), ValueError, "dtype must be one of torch.bfloat16, torch.float16, torch.float32"),
    ((None, 64, torch.bfloat16, 0), ValueError, "max_tokens must be a positive int or None"),
    (("world", 64, torch.bfloat16), TypeError, "group must be a torch.distributed ProcessGroup or None"),
], ids=["hidden", "dtype", "max_tokens", "group"])
def test_prepare_refuses_arguments_that_cannot_be_right(arguments, error, message):
    import fxfuse

    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        fxfuse.prepare(*arguments)
