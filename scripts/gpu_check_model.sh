#!/usr/bin/env bash
# One GPU session for the compiled model: install the carried wheels (.whl/: flashinfer-python 0.6.3
# + apache-tvm-ffi), run the GPU tests (FlashInfer kernel, then the compiled model captured in a CUDA
# graph on 2 ranks sharing the GPU), `fxfuse bench model` (deepseek-v3 at full width, a few layers),
# then `fxfuse run` on CUDA with CUDA graphs vs eager. Each part has its own time limit: the bench
# gets what is left of BUDGET_S after RUN_RESERVE_S is set aside for the run, and stops capturing
# 80 s before its limit to write what it measured, so one stuck part does not eat the others. The first
# FlashInfer use JIT-compiles trtllm_comm (about 2 minutes). Logs and results go to $OUT (at most 8
# files: pytest_gpu.log, test_graphs.tar.gz, bench_model.log + its JSON/md/PNG, run.log, run.json).
# Usage (device tool, carry [".whl"]): scripts/gpu_check_model.sh
# A subset, e.g.: PARTS="tests bench" TESTS=tests/gpu/test_compiled_model_cuda_graph.py PYTEST_STOP= \
#   BENCH_REPEATS=30 BENCH_ITERS=10 scripts/gpu_check_model.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-gpu}
BUDGET_S=${BUDGET_S:-550}      # whole script; keep the device call's timeout above it
RUN_RESERVE_S=${RUN_RESERVE_S:-75}
BENCH_LAYERS=${BENCH_LAYERS:-4}
BENCH_REPEATS=${BENCH_REPEATS:-10}   # timing samples per point; each is BENCH_ITERS graph replays
BENCH_ITERS=${BENCH_ITERS:-5}
PARTS=${PARTS:-"tests bench run"}    # which parts to run
TESTS=${TESTS:-tests/gpu}            # pytest paths, in order
PYTEST_STOP=${PYTEST_STOP--x}        # set PYTEST_STOP= to run every test after a failure
export FXFUSE_GPU_TEST_DUMP_DIR=/tmp/fxfuse-test-graphs  # graphs before/after the pass, tarred into $OUT
mkdir -p "$OUT"
status=0

if [ ! -d /tmp/site/flashinfer ]; then  # the device command may have installed them already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/fxfuse-install.log 2>&1 \
  || { echo "editable install of fxfuse failed:"; cat /tmp/fxfuse-install.log; exit 1; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import sys, torch, importlib.metadata as m; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), m.version('flashinfer-python'))"
} 2>&1 | tee "$OUT/pytest_gpu.log"

case " $PARTS " in *" run "*) reserve=$RUN_RESERVE_S ;; *) reserve=0 ;; esac

if [[ " $PARTS " == *" tests "* ]]; then
  # shellcheck disable=SC2086  # TESTS and PYTEST_STOP are word lists
  timeout 360 python3 -m pytest -m gpu $TESTS $PYTEST_STOP -v -rs -p no:cacheprovider --durations=8 2>&1 \
    | tee -a "$OUT/pytest_gpu.log" || status=1
  [ -d "$FXFUSE_GPU_TEST_DUMP_DIR" ] && tar czf "$OUT/test_graphs.tar.gz" -C "$(dirname "$FXFUSE_GPU_TEST_DUMP_DIR")" \
    "$(basename "$FXFUSE_GPU_TEST_DUMP_DIR")"
fi

if [[ " $PARTS " == *" bench "* ]]; then
  left=$((BUDGET_S - SECONDS - reserve))
  echo "bench model: ${left}s of ${BUDGET_S}s" | tee "$OUT/bench_model.log"
  if [ "$left" -gt 90 ]; then
    timeout "$left" python3 -m fxfuse --verbose bench model --tp 1 --layers "$BENCH_LAYERS" --tokens 1,4,16,64 --batch 1,8 \
      --backends eager,inductor,fxfuse --repeats "$BENCH_REPEATS" --iters "$BENCH_ITERS" \
      --time-budget-s $((left - 80)) --out-dir "$OUT" 2>&1 | tee -a "$OUT/bench_model.log" || status=1
  else
    echo "skipped: too little time left" | tee -a "$OUT/bench_model.log"; status=1
  fi
fi

if [[ " $PARTS " == *" run "* ]]; then
  left=$((BUDGET_S - SECONDS))
  [ "$left" -lt "$RUN_RESERVE_S" ] && left=$RUN_RESERVE_S
  timeout "$left" python3 -m fxfuse --verbose run --device cuda --tp 1 --backend fxfuse --compare eager --preset tiny \
    --dtype bfloat16 --batch 2 --prompt-len 16 --tokens 4 --steps 16 --json "$OUT/run.json" 2>&1 \
    | tee "$OUT/run.log" || status=1
fi
exit $status
