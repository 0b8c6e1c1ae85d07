"""The fused op's C++ fallback (fxfuse/op/kernels/native_fallback.cpp), built here and driven with CPU tensors on
two gloo ranks: shapes Python registered run in C++ (same values as the Python plan, donation, copies
of misaligned inputs, counted under their plan's reason), others go back to the Python kernel;
installing it replaces the public overloads' CUDA kernel; no compiler or a failing build leaves the
Python kernel in place with a warning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from nccl_plan_helpers import use_nccl_plans

from fxfuse.op.kernels.native_build import compiler
from fxfuse.op.reference import add_rmsnorm
from fxfuse.runner.launch import run_on_ranks

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
OVERLOADS = ("allreduce_residual_rmsnorm", "allreduce_residual_rmsnorm.tensor_eps",
             "allreduce_residual_rmsnorm.donate_x", "allreduce_residual_rmsnorm.donate_x_tensor_eps",
             "all_reduce", "all_reduce_")


@pytest.fixture(scope="module")
def native_cache(native_library):
    """The session's cache folder holding the built library (`native_library`); ranks started while it is
    set load it from there."""
    previous = os.environ.get("FXFUSE_NATIVE_CACHE")
    os.environ["FXFUSE_NATIVE_CACHE"] = native_library
    yield native_library
    if previous is None:
        del os.environ["FXFUSE_NATIVE_CACHE"]
    else:
        os.environ["FXFUSE_NATIVE_CACHE"] = previous


def _native_on_rank(ctx):
    """Python decides each shape once (an NCCL plan, registered with C++), then C++ runs its calls."""
    from fxfuse.op.kernels.native_fallback import calls_by_reason
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.plans import fusion_stats, reset_fusion_stats
    from fxfuse.op.runtime.registration import install_native_fallback

    name = use_nccl_plans(ctx)
    out = {"installed": install_native_fallback(), "cases": []}
    out["cuda_kernels"] = {o: _cuda_kernel_source(f"fxfuse::{o}") for o in OVERLOADS}
    run = torch.ops.fxfuse_native.run
    for dtype in (torch.float32, torch.float16):
        for shape, with_residual in (((5, 64), True), ((2, 3, 100), False)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + ctx.rank)).to(dtype)
            common = torch.Generator().manual_seed(7)
            residual = torch.randn(shape, generator=common).to(dtype) if with_residual else None
            weight = (1 + 0.1 * torch.randn(shape[-1], generator=common)).to(dtype)
            python = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight, 1e-5, name)  # decides, registers
            donated_x = x.clone()
            donated = run(donated_x, residual, weight, 1e-5, name, True)
            padded = torch.cat([torch.zeros(1, dtype=dtype), x.flatten()])[1:].view(shape)  # 4-byte offset
            residual_padded = None
            if with_residual:
                residual_padded = torch.cat([torch.zeros(1, dtype=dtype), residual.flatten()])[1:].view(shape)
            out["cases"].append(dict(
                x=x, residual=residual, weight=weight, python=python, functional=run(x, residual, weight, 1e-5, name, False),
                donated=donated, unaligned=run(padded, residual_padded, weight, 1e-5, name, False),
                x_after_donation=donated_x, x_kept=torch.equal(padded, x),
                aliases=[o.untyped_storage().data_ptr() == donated_x.untyped_storage().data_ptr() for o in donated]))
    out["plans"] = len(cuda_dispatch._PLANS)
    out["cpp_calls"] = sum(calls_by_reason().values())
    out["stats"] = fusion_stats()
    cuda_dispatch.forget_plans(name)  # C++ forgets too: the next call goes to the Python kernel (CPU's: the reference)
    case = out["cases"][0]
    out["after_forget"] = run(case["x"], case["residual"], case["weight"], 1e-5, name, False)
    out["cpp_calls_after_forget"] = sum(calls_by_reason().values())
    reset_fusion_stats()
    out["cpp_calls_after_reset"] = sum(calls_by_reason().values())
    return out


def _cuda_kernel_source(op: str) -> str:
    """The file that registered `op`'s CUDA kernel, from the dispatcher's own table."""
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith("CUDA:"):
            return line.split("registered at ")[1].split(":")[0]
    return ""


@pytest.mark.slow
def test_registered_shapes_run_in_cpp_with_the_python_plans_values(native_cache):
    rank0, rank1 = run_on_ranks(_native_on_rank, 2, timeout_s=300)
    assert rank0["installed"] and all(path.endswith("native_fallback.cpp") for path in rank0["cuda_kernels"].values())
    for case0, case1 in zip(rank0["cases"], rank1["cases"]):
        reduced = case0["x"] + case1["x"]
        expected = add_rmsnorm(reduced, case0["residual"], case0["weight"], 1e-5)
        for key in ("functional", "donated", "unaligned"):  # on CPU the C++ path's norm is the reference
            torch.testing.assert_close(case0[key], expected, rtol=0, atol=0)
            torch.testing.assert_close(case0[key], case1[key], rtol=0, atol=0)
        # the Python plan's norm is the Triton kernel (interpreted here): the same add, the norm within a rounding step
        tolerance = dict(rtol=1e-6, atol=1e-6) if case0["x"].dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(case0["python"][1], expected[1], rtol=0, atol=0)
        torch.testing.assert_close(case0["python"][0], expected[0], **tolerance)
        torch.testing.assert_close(case0["x_after_donation"], reduced, rtol=0, atol=0)  # reduced in x's memory
        assert case0["x_kept"] and not any(case0["aliases"])
    # 4 shapes decided once each in Python; their 12 later calls ran in C++, counted under the plans' reason
    assert rank0["plans"] == 4 and rank0["cpp_calls"] == 12
    assert sum(rank0["stats"]["fallback"].values()) == 16
    assert all("PCIe all-reduce unavailable" in reason for reason in rank0["stats"]["fallback"])
    case0, case1 = rank0["cases"][0], rank1["cases"][0]
    torch.testing.assert_close(rank0["after_forget"], add_rmsnorm(case0["x"] + case1["x"], case0["residual"], case0["weight"], 1e-5))
    assert rank0["cpp_calls_after_forget"] == 12
    assert rank0["cpp_calls_after_reset"] == 0


def _native_all_reduce_on_rank(ctx):
    """The all-reduce-only op: Python decides each shape once (an NCCL plan, registered with C++), then C++
    runs its calls, functional (a copy) and in place (x itself)."""
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.plans import fusion_stats
    from fxfuse.op.runtime.registration import install_native_fallback

    name = use_nccl_plans(ctx)
    out = {"installed": install_native_fallback(), "cases": []}
    run = torch.ops.fxfuse_native.run_all_reduce
    for dtype, shape in ((torch.float32, (5, 64)), (torch.bfloat16, (2, 3, 96))):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(20 + ctx.rank)).to(dtype)
        python = cuda_dispatch.all_reduce_cuda(x, name, False)  # decides, registers
        before = x.clone()
        functional = run(x, name, False)
        in_place = x.clone()
        returned = run(in_place, name, True)
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # x's values, not contiguous: reduced via a copy
        run(strided, name, True)
        out["cases"].append(dict(x=x, python=python, functional=functional, in_place=in_place, strided=strided,
                                 same_memory=returned.data_ptr() == in_place.data_ptr(), x_kept=torch.equal(x, before)))
    out["stats"] = fusion_stats()["all_reduce"]
    return out


@pytest.mark.slow
def test_all_reduce_only_shapes_run_in_cpp(native_cache):
    rank0, rank1 = run_on_ranks(_native_all_reduce_on_rank, 2, timeout_s=300)
    assert rank0["installed"]
    for case0, case1 in zip(rank0["cases"], rank1["cases"]):
        reduced = case0["x"] + case1["x"]
        for key in ("python", "functional", "in_place", "strided"):
            torch.testing.assert_close(case0[key], reduced, rtol=0, atol=0, msg=key)
        assert case0["same_memory"] and case0["x_kept"]
    # 2 shapes decided once each in Python (1 call each), 3 more calls each in C++: 8, all on NCCL's plan
    assert sum(rank0["stats"].values()) == 8 and {mode for (_, mode, _, _) in rank0["stats"]} == {"fallback"}


def _install_report(env: dict) -> list[str]:
    """In a fresh interpreter: what installing returned, and which files registered the overloads' CUDA kernels."""
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from fxfuse.op.kernels.native_fallback import native_installed\n"
        "from fxfuse.op.runtime.registration import install_native_fallback\n"
        "print(install_native_fallback(), native_installed())\n"
        "lines = [l for o in %r for l in torch._C._dispatch_dump('fxfuse::' + o).splitlines() if l.startswith('CUDA:')]\n"
        "print(sorted({l.split('registered at ')[1].split(':')[0].rsplit('/', 1)[-1] for l in lines}))\n"
    ) % (OVERLOADS,)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines() + [done.stderr]


@pytest.mark.parametrize("env, warning", [
    ({"FXFUSE_NATIVE": "0"}, None),
    ({"CXX": "/nonexistent/c++"}, "no C++ compiler"),
    ({"CXX": "false"}, "the C++ fallback op is unavailable"),
], ids=["disabled", "no_compiler", "build_fails"])
def test_without_the_library_the_python_cuda_kernel_stays(tmp_path, env, warning):
    installed, sources, stderr = _install_report({"FXFUSE_NATIVE_CACHE": str(tmp_path), **env})
    assert installed == "False False" and sources == "['registration.py']"
    assert (warning in stderr) if warning else "unavailable" not in stderr


@pytest.mark.slow
def test_install_replaces_every_overloads_cuda_kernel(native_cache):
    installed, sources, _ = _install_report({})
    assert installed == "True True" and sources == "['native_fallback.cpp']"


def test_norm_kernels_compiled_before_the_installation_are_registered_by_it(monkeypatch):
    """A kernel compiled before the C++ path was installed (an eager call before `fxfuse.prepare`) is
    registered when it is; one compiled after, at once; none if the installation failed."""
    from fxfuse.op.kernels import native_fallback

    registered = []
    for name, value in (("_INSTALLED", []), ("_NORM_KERNELS", {})):
        monkeypatch.setattr(native_fallback, name, value)
    monkeypatch.setattr(native_fallback, "_register_norm_kernel", lambda key, compiled, types: registered.append(key))
    native_fallback.offer_norm_kernel(("early",), object(), ["u64"])
    assert registered == [] and not native_fallback.installation_decided()
    native_fallback.record_installation(True)
    assert registered == [("early",)] and native_fallback.native_installed()
    native_fallback.offer_norm_kernel(("late",), object(), ["u64"])
    assert registered == [("early",), ("late",)]
    monkeypatch.setattr(native_fallback, "_INSTALLED", [])
    native_fallback.record_installation(False)
    native_fallback.offer_norm_kernel(("after a failed build",), object(), ["u64"])
    assert registered == [("early",), ("late",)] and not native_fallback.native_installed()


_COMPILE_AND_REPORT = """
import os, torch, torch.distributed as dist
import fxfuse.backend
import fxfuse.rewrite.recorder
from fxfuse.bench.fallback_blocks import PRODUCER_K, block
from fxfuse.op.kernels.native_fallback import native_installed
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
seen, really_on_cuda = [], fxfuse.rewrite.recorder.fused_sites_on_cuda
def on_cuda(graph):  # CPU tensors here: answer as for a CUDA graph, so the pass installs as it would there
    seen.append(really_on_cuda(graph))
    return True
fxfuse.rewrite.recorder.fused_sites_on_cuda = on_cuda
group_name = dist.group.WORLD.group_name
backend = fxfuse.backend.FxfuseBackend(fuse_without_fast_kernel=True)
x, residual, weight, proj = torch.randn(4, PRODUCER_K), torch.randn(4, 64), torch.randn(64), torch.randn(PRODUCER_K, 64)
out = torch.compile(block, backend=backend, fullgraph=True)(x, residual, weight, proj, group_name)
torch.testing.assert_close(out, block(x, residual, weight, proj, group_name))
print(backend.records[-1].stats.fused, seen, native_installed())
"""


@pytest.mark.slow
def test_the_backend_installs_it_while_inductor_compiles(native_cache, tmp_path):
    """The pass installs the C++ fallback from inside Inductor's compile (fake tensors active) when the
    graph has fused CUDA sites; the CPU graph itself (not CUDA: the pass's own check says False) still
    computes what the unfused block does."""
    # a fresh Inductor cache: a hit would load the compiled graph without running the pass under test
    env = {**os.environ, "STORE": str(tmp_path / "store"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", _COMPILE_AND_REPORT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "1 [False] True"
