"""The fault matrix (issue 21): one failure injected at each step of the fused op's first-call path, on
exactly one rank, and every rank ends within a deadline with the same outcome: all run the same plan,
or all raise the same error naming the rank and the step.

The first-call path runs for real (group agreement, decision table, workspace registry, shared IPC
buffers, plan agreement) on CPU tensors over gloo ranks; only the CUDA parts are fakes
(tests/fault_fakes.py: a fake H200 with NVSwitch links and FlashInfer 0.7.2, whose TensorRT-LLM
kernel is a gloo all-reduce plus the reference norm). docs/FAULTS.md lists every row with its outcome.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from fault_fakes import FakeTrtllmKernels, patched, raising

from fxfuse.runner.launch import run_on_ranks

HIDDEN = 1024  # wide enough for the TensorRT-LLM kernel's launch shape (whole warps)
TOKENS = 3
#: Seconds within which every rank must finish one scenario (each is a few collectives on gloo).
DEADLINE_S = 60.0

#: Group-level steps: a failure raises `RankStepFailed` on every rank, naming the rank and the step.
GROUP_STEP_FAULTS = {
    "bad FXFUSE_FUSION": "reading the FXFUSE_* settings",
    "bad FXFUSE_MAX_TOKENS": "reading the FXFUSE_* settings",
    "bad FXFUSE_TOPOLOGY": "reading the FXFUSE_* settings",
    "missing FXFUSE_THRESHOLDS file": "reading the thresholds table",
    "invalid FXFUSE_THRESHOLDS JSON": "reading the thresholds table",
    "FlashInfer version unreadable": "reading the FlashInfer version",
    "GPU query fails": "reading the GPU model and arch",
    "PCIe tuning file (FlashInfer import) fails": "reading the PCIe tuning file",
}
#: Facts every rank must share: a difference raises `ConfigMismatch` on every rank, naming the field.
MISMATCHES = {
    "FXFUSE_FUSION differs": "settings",
    "FlashInfer version differs": "flashinfer_version",
    "PCIe tuning file differs": "pcie_tune_digest",
    "GPU model differs": "gpu",
}
#: Workspace steps: a failure makes every rank run the NCCL plan, for the same reason naming rank and step.
WORKSPACE_STEP_FAULTS = {
    "topology probe (NVML) fails": "link probe failed",
    "FlashInfer import / JIT fails": "loading the kernels (FlashInfer import and JIT)",
    "too little free GPU memory": "checking free GPU memory",
    "CUDA runtime does not load": "loading the CUDA runtime",
    "cudaSetDevice fails": "selecting the GPU (cudaSetDevice)",
    "cudaMalloc fails": "allocating the shared buffers (cudaMalloc)",
    "IPC handle export fails": "exporting IPC handles (cudaIpcGetMemHandle)",
    "IPC handle open fails": "opening the peers' IPC handles (cudaIpcOpenMemHandle)",
    "workspace initialisation fails": "initialising the workspace",
}
#: Per-shape steps, after the plan is made: a failure raises `RankStepFailed` on every rank.
PLAN_STEP_FAULTS = {
    "add-RMSNorm kernel build (Triton) fails": "compiling the add-RMSNorm kernel (Triton)",
}
SCENARIOS = ["no fault", *GROUP_STEP_FAULTS, *MISMATCHES, *WORKSPACE_STEP_FAULTS, *PLAN_STEP_FAULTS]


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """Set environment variables for one scenario, dropping the cached settings and thresholds before
    and after it."""
    from fxfuse.op.decide.settings import current_settings
    from fxfuse.op.decide.thresholds import current_thresholds

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    current_settings.cache_clear(), current_thresholds.cache_clear()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        current_settings.cache_clear(), current_thresholds.cache_clear()


def _injection(name: str, rank: int, bad: bool, tmp: str):
    """(patches, environment, kernel-library failures) of scenario `name` on this rank."""
    from fxfuse.op.decide import group_config
    from fxfuse.op.decide.flashinfer_version import features
    from fxfuse.op.runtime import planning, workspace

    patches, env, fail = [], {}, {}
    if name in PLAN_STEP_FAULTS:  # every rank plans the NCCL fallback, whose norm kernel one rank fails to build
        env = {"FXFUSE_FUSION": "off"}
    if not bad or name == "no fault":
        return patches, env, fail
    if name.startswith("bad FXFUSE_"):
        env = {"FXFUSE_FUSION": "sometimes", "FXFUSE_MAX_TOKENS": "many", "FXFUSE_TOPOLOGY": "ring"}
        env = {k: v for k, v in env.items() if k in name}
    elif name == "missing FXFUSE_THRESHOLDS file":
        env = {"FXFUSE_THRESHOLDS": os.path.join(tmp, "no-such-thresholds.json")}
    elif name == "invalid FXFUSE_THRESHOLDS JSON":
        path = os.path.join(tmp, f"broken-{rank}.json")
        with open(path, "w") as f:
            f.write('{"format": ')
        env = {"FXFUSE_THRESHOLDS": path}
    elif name == "FlashInfer version unreadable":
        patches = [(group_config, "installed_features", raising("metadata of flashinfer-python is unreadable"))]
    elif name == "GPU query fails":
        patches = [(group_config, "device_facts", raising("cudaGetDeviceProperties failed"))]
    elif name == "PCIe tuning file (FlashInfer import) fails":
        patches = [(group_config, "pcie_tune_digest", raising("No module named 'flashinfer.comm.pcie_ipc_tuning'"))]
    elif name == "FXFUSE_FUSION differs":
        env = {"FXFUSE_FUSION": "off"}
    elif name == "FlashInfer version differs":
        patches = [(group_config, "installed_features", lambda: features("0.6.3"))]
    elif name == "PCIe tuning file differs":
        patches = [(group_config, "pcie_tune_digest", lambda *a: "/tmp/other-tuning.json:0123456789abcdef")]
    elif name == "GPU model differs":
        patches = [(group_config, "device_facts", lambda device: group_config.DeviceFacts("NVIDIA H100", 90, f"gpu-{rank}"))]
    elif name == "topology probe (NVML) fails":
        patches = [(group_config, "probe_local_view", raising("NVML Shared Library Not Found"))]
    elif name == "too little free GPU memory":
        patches = [(workspace, "free_device_memory", lambda: 0)]
    elif name == "add-RMSNorm kernel build (Triton) fails":
        patches = [(planning, "compile_norm_kernel", raising("ptxas fatal: out of disk space"))]
        env = {"FXFUSE_FUSION": "off"}
    else:
        fail = {
            "FlashInfer import / JIT fails": "load", "CUDA runtime does not load": "runtime", "cudaSetDevice fails": "set_device",
            "cudaMalloc fails": "malloc", "IPC handle export fails": "ipc_handle", "IPC handle open fails": "open",
            "workspace initialisation fails": "init",
        }[name]
        fail = {fail: rank}
    return patches, env, fail


def _fake_machine(rank: int, world_size: int, kernels) -> list:
    """Patches that make this CPU process look like rank `rank` of an NVSwitch-connected H200 group
    with FlashInfer 0.7.2 (no PCIe tuning file), whose TensorRT-LLM kernel library is `kernels`."""
    from fxfuse.op.decide import group_config
    from fxfuse.op.decide.flashinfer_version import features
    from fxfuse.op.decide.topology import LocalView, Topology
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.workspace import TRTLLM

    uuids = [f"gpu-{r}" for r in range(world_size)]
    links = tuple((u, Topology.NVSWITCH) for u in uuids if u != uuids[rank])
    return [
        (group_config, "device_facts", lambda device: group_config.DeviceFacts("NVIDIA H200", 90, uuids[rank])),
        (group_config, "probe_local_view", lambda host, uuid, index: LocalView(host, uuid, links, "fake NVML")),
        (group_config, "installed_features", lambda: features("0.7.2")),
        (group_config, "pcie_tune_digest", lambda *a: ""),
        (TRTLLM, "_kernels", kernels),
    ]


def _scenario(ctx, name: str, tmp: str, env_everywhere: dict[str, str]) -> tuple:
    """Run the op's first call under scenario `name` (the fault on the last rank); (outcome, seconds)."""
    from fxfuse.op.runtime import cuda_dispatch

    group = dist.new_group(list(range(ctx.world_size)))  # a fresh name: no state from other scenarios
    bad = ctx.rank == ctx.world_size - 1
    patches, env, fail = _injection(name, ctx.rank, bad, tmp)
    kernels = FakeTrtllmKernels(ctx.rank, fail)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(ctx.rank)).half()
    common = torch.Generator().manual_seed(7)
    residual, weight = torch.randn(TOKENS, HIDDEN, generator=common).half(), (1 + 0.1 * torch.randn(HIDDEN, generator=common)).half()
    start = time.monotonic()
    with patched(*_fake_machine(ctx.rank, ctx.world_size, kernels), *patches), _env({**env_everywhere, **env}):
        try:
            normed, residual_out = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight, 1e-6, group.group_name)
            plan = cuda_dispatch._PLANS[cuda_dispatch.plan_key(group.group_name, x, residual, weight)]
            outcome = ("plan", type(plan).__name__, plan.decision.mode.value, plan.decision.reason, normed, residual_out)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome = ("raise", type(exc).__name__, str(exc))
    return outcome, time.monotonic() - start


def _matrix_on_rank(ctx, scenarios: list[str], tmp: str, env_everywhere: dict[str, str]) -> dict:
    return {name: _scenario(ctx, name, tmp, env_everywhere) for name in scenarios}


def _same_outcome_everywhere(results: list[dict], name: str) -> tuple:
    outcomes = [r[name][0] for r in results]
    first = outcomes[0]
    for rank, outcome in enumerate(outcomes[1:], 1):
        assert outcome[:4] == first[:4], f"{name}: rank {rank} ended with {outcome[:4]}, rank 0 with {first[:4]}"
        if first[0] == "plan":
            torch.testing.assert_close(outcome[4:], first[4:], rtol=0, atol=0)
    slowest = max(r[name][1] for r in results)
    assert slowest < DEADLINE_S, f"{name}: a rank took {slowest:.1f} s"
    return first


def _check_matrix(results: list[dict], world_size: int) -> None:
    bad = world_size - 1
    assert _same_outcome_everywhere(results, "no fault")[:3] == ("plan", "TrtllmPlan", "oneshot")
    for name, step in GROUP_STEP_FAULTS.items():
        outcome = _same_outcome_everywhere(results, name)
        assert outcome[:2] == ("raise", "RankStepFailed") and f"rank {bad}, {step}" in outcome[2], (name, outcome)
    for name, field in MISMATCHES.items():
        outcome = _same_outcome_everywhere(results, name)
        assert outcome[:2] == ("raise", "ConfigMismatch") and f"{field}: rank 0=" in outcome[2], (name, outcome)
    for name, step in WORKSPACE_STEP_FAULTS.items():
        outcome = _same_outcome_everywhere(results, name)
        assert outcome[:3] == ("plan", "NcclPlan", "fallback") and step in outcome[3], (name, outcome)
        if name != "topology probe (NVML) fails":  # that one names the GPU whose probe failed
            assert f"rank {bad}, {step}" in outcome[3], (name, outcome)
    for name, step in PLAN_STEP_FAULTS.items():
        outcome = _same_outcome_everywhere(results, name)
        assert outcome[:2] == ("raise", "RankStepFailed") and f"rank {bad}, {step}" in outcome[2], (name, outcome)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_fault_ends_the_same_way_on_every_rank(world_size, tmp_path):
    results = run_on_ranks(_matrix_on_rank, world_size, SCENARIOS, str(tmp_path), {}, timeout_s=900)
    _check_matrix(results, world_size)


def test_a_bad_setting_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    """Quick loop: the agreement on a bad FXFUSE_FUSION, and a differing one, on two ranks."""
    results = run_on_ranks(_matrix_on_rank, 2, ["bad FXFUSE_FUSION", "FXFUSE_FUSION differs"], str(tmp_path), {},
                           timeout_s=300)
    outcome = _same_outcome_everywhere(results, "bad FXFUSE_FUSION")
    assert outcome[:2] == ("raise", "RankStepFailed")
    assert ("rank 1, reading the FXFUSE_* settings: ValueError: FXFUSE_FUSION='sometimes': expected one of auto, oneshot, "
            "twoshot, pcie, pcie_one_kernel, off") in outcome[2]
    assert _same_outcome_everywhere(results, "FXFUSE_FUSION differs")[:2] == ("raise", "ConfigMismatch")


def _cpu_kernel_on_rank(ctx, bad_env: dict[str, str]) -> tuple[str, str]:
    """The CPU reference kernel's first call with `bad_env` on the last rank only."""
    import fxfuse.op.runtime.registration  # noqa: F401 - the op's CPU kernel
    from fxfuse.op.schema import allreduce_residual_rmsnorm

    group = dist.new_group(list(range(ctx.world_size)))
    env = bad_env if ctx.rank == ctx.world_size - 1 else {}
    with _env(env):
        try:
            allreduce_residual_rmsnorm(torch.randn(2, 8), None, torch.ones(8), 1e-6, group.group_name)
            return ("ran", "")
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            return (type(exc).__name__, str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("bad_env, step", [
    ({"FXFUSE_FUSION": "sometimes"}, "reading the FXFUSE_* settings"),
    ({"FXFUSE_THRESHOLDS": "/no/such/thresholds.json"}, "reading the thresholds table"),
], ids=["fusion", "thresholds"])
def test_bad_settings_are_errors_on_cpu_too(bad_env, step):
    """On CPU (the runner's default) a bad setting was silently ignored: now the CPU kernel's first call
    agrees on it as the CUDA one does."""
    outcomes = run_on_ranks(_cpu_kernel_on_rank, 2, bad_env, timeout_s=300)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "RankStepFailed" and f"rank 1, {step}" in outcomes[0][1]


def _native_build_fails_on_last_rank(ctx, native_cache: str) -> dict:
    """The C++ fallback builds on every rank but the last (no writable cache there); the op's calls
    then go through C++ on some ranks and Python on the others: the same collectives, the same values."""
    from fxfuse.op.kernels import native_build
    from fxfuse.op.kernels.native_fallback import calls_by_reason
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.runtime.registration import install_native_fallback

    os.environ["FXFUSE_NATIVE_CACHE"] = native_cache
    bad = ctx.rank == ctx.world_size - 1
    with patched(*([(native_build, "cache_dir", raising("no home directory and no writable cache"))] if bad else [])):
        installed = install_native_fallback()
    group = dist.new_group(list(range(ctx.world_size)))
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(ctx.rank)).half()
    weight = torch.ones(HIDDEN).half()
    outputs = [cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, None, weight, 1e-6, group.group_name)]  # decides
    for _ in range(2):
        if installed:  # the CUDA dispatcher's entry on a GPU; called directly on CPU tensors
            outputs.append(torch.ops.fxfuse_native.run(x, None, weight, 1e-6, group.group_name, False))
        else:
            outputs.append(cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, None, weight, 1e-6, group.group_name))
    return {"installed": installed, "cpp_calls": sum(calls_by_reason().values()), "outputs": outputs}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_native_build_failing_on_one_rank_changes_no_collective(world_size, native_library):
    results = run_on_ranks(_native_build_fails_on_last_rank, world_size, native_library, timeout_s=600)
    assert [r["installed"] for r in results] == [True] * (world_size - 1) + [False]
    assert [r["cpp_calls"] for r in results] == [2] * (world_size - 1) + [0]
    for r in results[1:]:
        torch.testing.assert_close(r["outputs"], results[0]["outputs"], rtol=0, atol=0)
