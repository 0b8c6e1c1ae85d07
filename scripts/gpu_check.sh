#!/usr/bin/env bash
# One GPU session on the lent device. When to run it: after a change to anything only a GPU exercises (the op's
# CUDA path: kernels, plans, workspaces, the FlashInfer adapters, the C++ fallback's CUDA parts; the benchmarks),
# and to refresh the numbers in DEVELOPERS.md / BENCHMARKS.md. It installs the carried FlashInfer wheels (WHEELS,
# default .whl/) and fxfuse (editable, no deps), then runs the parts named in PARTS, each under its own time limit,
# writing logs and results to $OUT/results/, tarred at the end into $OUT/results.tar.gz (the device
# tool returns at most 8 files), with env.txt and the pytest log also beside it.
#   tests     pytest -m gpu $TESTS (default tests/gpu)                     -> pytest_gpu.log
#             (TESTS is split into words unquoted: put a -k expression with spaces in PYTEST_ADDOPTS instead)
#   fallback  fxfuse bench fallback --quant none (one-rank NCCL: fallback vs Inductor, static and
#             dynamic shapes)                                               -> fallback_*.json/.md
#   quantbench  fxfuse bench fallback, the whole sweep (none/group/row/tensor FP8 after the norm, static
#             and dynamic shapes, hidden 7168 and 4096, 1-4096 tokens) $QUANT_FLAGS, starting no point
#             after QUANTBENCH_TIMEOUT_S - 60 s (the rest listed as skipped) -> fallback_*.json/.md
#   model     fxfuse bench model --tp 1 --single-rank-collectives $MODEL_FLAGS -> model_*.json/.md
#   kernel    fxfuse bench kernel --world-size 2 (ranks share the GPU: correctness only)
# The first FlashInfer use JIT-compiles its kernels (trtllm_comm about 2 minutes, the PCIe all-reduce
# about 15 s). NVLink multicast stays off in every process (docs/DESIGN.md, rule 6).
# Usage (device tool, carry [".whl072s"]): WHEELS=.whl072s PARTS="tests" scripts/gpu_check.sh, where .whl072s holds
#        apache-tvm-ffi and the FlashInfer 0.7.2.post1 wheel trimmed by scripts/trim_flashinfer_wheel.py (the whole
#        wheel with the tree is over the 64 MiB a call carries)
#        PARTS=quantbench scripts/gpu_check.sh   (alone in one call: it takes up to 9 of the call's 10 minutes;
#        QUANT_FLAGS="--hidden 4096" or "--quant group,row" to split the sweep over calls)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/fxfuse-gpu}
OUT=$FINAL/results
WHEELS=${WHEELS:-.whl}
PARTS=${PARTS:-"tests fallback"}
TESTS=${TESTS:-tests/gpu}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-420}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-240}
QUANTBENCH_TIMEOUT_S=${QUANTBENCH_TIMEOUT_S:-540}
QUANT_FLAGS=${QUANT_FLAGS:-}  # e.g. --hidden 7168 --quant group,row
MODEL_LAYERS=${MODEL_LAYERS:-2}
MODEL_FLAGS=${MODEL_FLAGS:-}  # e.g. --no-cuda-graphs, --dynamic both
mkdir -p "$OUT"
status=0

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/fxfuse-install.log 2>&1 \
  || { echo "editable install of fxfuse failed:"; cat /tmp/fxfuse-install.log; exit 1; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import sys, torch, triton, importlib.metadata as m
v = lambda d: (m.version(d) if any(x.metadata['Name'] == d for x in m.distributions()) else 'not installed')
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'flashinfer', v('flashinfer-python'), 'nvidia-ml-py', v('nvidia-ml-py'))"
} 2>&1 | tee "$OUT/env.txt"

if [[ " $PARTS " == *" tests "* ]]; then
  # shellcheck disable=SC2086  # TESTS is a word list
  timeout "$TESTS_TIMEOUT_S" python3 -m pytest -m gpu $TESTS -v -rs -p no:cacheprovider --durations=15 2>&1 \
    | tee "$OUT/pytest_gpu.log" || status=1
fi
if [[ " $PARTS " == *" fallback "* ]]; then
  timeout "$BENCH_TIMEOUT_S" python3 -m fxfuse.bench.fallback --quant none --time-budget-s $((BENCH_TIMEOUT_S - 40)) \
    --out-dir "$OUT" 2>&1 | tee "$OUT/fallback.log" || status=1
fi
if [[ " $PARTS " == *" quantbench "* ]]; then
  # shellcheck disable=SC2086  # QUANT_FLAGS is a word list
  timeout "$QUANTBENCH_TIMEOUT_S" python3 -m fxfuse.bench.fallback --time-budget-s $((QUANTBENCH_TIMEOUT_S - 60)) $QUANT_FLAGS \
    --out-dir "$OUT" 2>&1 | tee "$OUT/quantbench.log" || status=1
fi
if [[ " $PARTS " == *" model "* ]]; then
  # MODEL_FLAGS last, so that its --tokens / --batch / --backends replace the defaults here
  # shellcheck disable=SC2086  # MODEL_FLAGS is a word list
  timeout "$BENCH_TIMEOUT_S" python3 -m fxfuse --verbose bench model --tp 1 --single-rank-collectives --layers "$MODEL_LAYERS" \
    --tokens 1,4,16 --batch 1,8 --backends inductor,fxfuse --repeats 15 --iters 5 --time-budget-s $((BENCH_TIMEOUT_S - 60)) \
    --out-dir "$OUT" $MODEL_FLAGS 2>&1 | tee "$OUT/model.log" || status=1
fi
if [[ " $PARTS " == *" kernel "* ]]; then
  timeout "$BENCH_TIMEOUT_S" python3 -m fxfuse.bench.kernel --world-size 2 --tokens 1,16,128 --graph-iters 5 --repeats 3 \
    --out-dir "$OUT" 2>&1 | tee "$OUT/kernel.log" || status=1
fi
cp "$OUT/env.txt" "$FINAL/" 2>/dev/null; cp "$OUT/pytest_gpu.log" "$FINAL/" 2>/dev/null
tar czf "$FINAL/results.tar.gz" -C "$FINAL" results && rm -rf "$OUT"
exit $status
