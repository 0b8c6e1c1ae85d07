"""The compiled DeepSeek-V3 model under CUDA graphs at tensor parallel 8, its eight ranks on ONE GPU (issue 32).

The "deepseek-width" case of test_compiled_model_cuda_graph.py (DeepSeek-V3's widths, 3 layers: 1 dense +
2 MoE, 8 routed experts, every expert routed), whose heads (128), dense and expert FFN widths (18432,
2048) and vocabulary (129280) all shard 8 ways, compiled with `backend="fxfuse"` (inner Inductor) on 8
gloo ranks sharing the GPU, once with the TensorRT-LLM kernel (FXFUSE_TOPOLOGY=nvswitch) and once with the
one-kernel PCIe path forced (FXFUSE_TOPOLOGY=pcie FXFUSE_FUSION=pcie_one_kernel). That module's three
tests run here unchanged, on this module's `case_reports` (imported, so pytest collects them here too,
with ids ending in `ws8`): every all-reduce site fused (1 + 2 x 3), the fused kernel ran at every site
while the graph was captured, and the replay on fresh tokens equals the uncaptured compiled step and the
eager model. A fourth test prints the spawn's time and GPU memory per rank, and bounds the memory.

What the run needs (expected; to be measured on the H200, DEVELOPERS.md keeps the values):
- memory per rank: the CUDA context (about 0.5 GiB), the weights (1/8 of embedding, lm_head and three
  layers: about 1 GiB), the workspace, Inductor's code and the graph pool: expected 2-3 GiB on the GPU
  (asserted under 8 GiB), 2-4 GiB of host memory (Inductor; not printed);
- time: FlashInfer's kernels are built in the test process first (`build_flashinfer_kernels`: about 5
  minutes on a fresh machine, seconds once cached); then launch 10-20 s, and Inductor compiles the same
  graph on 8 ranks at once, each rank with cpu_count / 8 compile workers (TORCHINDUCTOR_COMPILE_THREADS)
  instead of one per core, so that 8 pools do not start 8 x cpu_count processes: expected 1-2 minutes on
  the device's 16 cores, to be measured. The spawn's timeout is `SPAWN_TIMEOUT_S`, 420 s.

Run exactly these tests on the lent device (carry [".whl072s"]): right after test_world_sizes_gpu.py's call,
while the machine is warm (FlashInfer's JIT cache kept: about 2-3 minutes), else about 8 minutes:
    WHEELS=.whl072s PARTS=tests TESTS=tests/gpu/test_compiled_model_tp8_gpu.py TESTS_TIMEOUT_S=540 scripts/gpu_check.sh
"""

from __future__ import annotations

import os
import time

import pytest
from flashinfer_gpu import FLASHINFER_GPU_MARKS, DeviceMemoryPeak, build_flashinfer_kernels
from test_compiled_model_cuda_graph import (  # noqa: F401 - the tests are collected here, on this module's fixture
    capture_and_compare,
    test_every_all_reduce_site_is_fused_in_the_compiled_graph,
    test_flashinfer_kernel_ran_at_every_site_during_capture,
    test_replay_on_fresh_inputs_matches_uncaptured_and_eager,
)

from fxfuse.runner.launch import run_on_ranks

pytestmark = FLASHINFER_GPU_MARKS

WORLD_SIZE = 8
#: (model, FxfuseBackend inner compiler, path), as test_compiled_model_cuda_graph.CASES names them: the
#: TensorRT-LLM kernel, and the one-kernel PCIe path forced (FXFUSE_FUSION=pcie_one_kernel; it needs no FlashInfer).
CASE = ("deepseek-width", "inductor", "trtllm")
ONE_KERNEL_CASE = ("deepseek-width", "inductor", "pcie_one_kernel")
#: Seconds the spawn may take (FlashInfer's JIT is done before, in this process).
SPAWN_TIMEOUT_S = 420
#: GPU memory one rank may hold (context, weights, workspace, Inductor's code, graph pool).
MAX_DEVICE_BYTES_PER_RANK = 8 << 30
#: What the spawn took, filled in by `case_reports`: the seconds of FlashInfer's build before it ("jit_s") and
#: of the spawn ("wall_s"), and the most GPU memory its ranks held together ("device_bytes").
SPAWN: dict = {}


@pytest.fixture(scope="module", params=[CASE, ONE_KERNEL_CASE], ids=lambda case: "-".join(case) + f"-ws{WORLD_SIZE}")
def case_reports(request):
    """((case, inner compiler, path), every rank's report) of one spawn of `WORLD_SIZE` ranks on the GPU."""
    SPAWN["jit_s"] = build_flashinfer_kernels() if request.param[2] == "trtllm" else 0.0
    with pytest.MonkeyPatch.context() as env, DeviceMemoryPeak() as memory:
        env.setenv("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or WORLD_SIZE) // WORLD_SIZE)))
        started = time.monotonic()
        reports = run_on_ranks(capture_and_compare, WORLD_SIZE, *request.param, timeout_s=SPAWN_TIMEOUT_S)
        SPAWN["wall_s"] = time.monotonic() - started
    SPAWN["device_bytes"] = memory.peak - memory.before
    for report in reports:
        assert report["ready"], f"fused workspace not created: {report.get('failure')}"
    return request.param, reports


def test_time_and_gpu_memory_per_rank(case_reports, capsys):
    """Prints what the spawn took (the numbers DEVELOPERS.md keeps) and bounds the GPU memory per rank."""
    per_rank = SPAWN["device_bytes"] / WORLD_SIZE
    with capsys.disabled():
        print(f"\n[tp{WORLD_SIZE} {'-'.join(case_reports[0])}] FlashInfer kernels built or loaded in {SPAWN['jit_s']:.0f} s; "
              f"spawn (launch, build, compile, capture, replays) {SPAWN['wall_s']:.1f} s; GPU {per_rank / 2**30:.2f} GiB per rank")
    assert per_rank < MAX_DEVICE_BYTES_PER_RANK, f"{per_rank / 2**30:.2f} GiB per rank"
