#!/usr/bin/env bash
# One GPU session for the FlashInfer path: install the carried wheels (.whl/: flashinfer-python
# 0.6.3 + apache-tvm-ffi), run the GPU tests, then `fxfuse bench kernel` on 2 ranks sharing the
# GPU (correctness only: those timings are labelled not meaningful). The first FlashInfer use
# JIT-compiles trtllm_comm (about 2 minutes). Logs and results go to $OUT (default /tmp/fxfuse-gpu).
# Usage (device tool, carry [".whl"]): scripts/gpu_check_flashinfer.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-gpu}
mkdir -p "$OUT"
status=0

if [ ! -d /tmp/site/flashinfer ]; then  # the device command may have installed them already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install of fxfuse failed:"; cat "$OUT/install.log"; exit 1; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import sys, torch, importlib.metadata as m; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), m.version('flashinfer-python'))"
} 2>&1 | tee "$OUT/env.txt"

timeout 300 python3 -m pytest -m gpu tests/gpu -x -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" || status=1

timeout 240 python3 -m fxfuse.bench.kernel --world-size 2 --graph-iters 5 --repeats 3 --out-dir "$OUT" 2>&1 \
  | tee "$OUT/bench_kernel.log" || status=1
exit $status
