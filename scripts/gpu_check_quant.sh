#!/usr/bin/env bash
# One GPU session for quantized weights (issue 15), on ONE GPU, no FlashInfer and no carried wheels. When to run
# it: after a change to models/quant (GEMMs, expert kernels, loaders) or to the model benchmark's quantized runs.
# 1. tests/gpu/test_quantized_gemm.py: FP8 / INT4 GEMMs at hidden 7168 vs the dequantized bf16 reference,
#    and quantized models compiled with fxfuse replayed in CUDA graphs (measured errors -> quant_errors.jsonl);
# 2. `fxfuse bench model --tp 1` (CUDA graphs, eager vs fxfuse) of deepseek-v3 (4 layers) in bf16 and fp8,
#    kimi-k2.5 (2 layers) in bf16 and int4, then deepseek-v3 fp8 with FXFUSE_FP8_GEMM=w8a8 if time is left:
#    step latency, weight and peak GPU memory per format -> bench_summary.md.
# Each part gets what is left of BUDGET_S (the whole script, default 340 s: keep the device call's timeout
# above it); a bench run that would start with less than 60 s left is skipped and says so. compressed-tensors
# is not needed (only the CPU tests use it). Files in $OUT (at most 8): pytest_quant.log, quant_errors.jsonl,
# bench_quant.log, bench_summary.md, bench_results.tar.gz (every run's JSON / markdown / PNG).
# Usage (device tool, no carry): scripts/gpu_check_quant.sh      A subset: PARTS=bench scripts/gpu_check_quant.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxfuse-gpu}
BUDGET_S=${BUDGET_S:-340}
TESTS_LIMIT_S=${TESTS_LIMIT_S:-170}
PARTS=${PARTS:-"tests bench"}
BENCH_DIR=/tmp/fxfuse-bench-quant
mkdir -p "$OUT" "$BENCH_DIR"
status=0

python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/fxfuse-install.log 2>&1 \
  || { echo "editable install of fxfuse failed:"; cat /tmp/fxfuse-install.log; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/pytest_quant.log"

if [[ " $PARTS " == *" tests "* ]]; then
  FXFUSE_GPU_RESULTS="$OUT/quant_errors.jsonl" timeout "$TESTS_LIMIT_S" python3 -m pytest -m gpu tests/gpu/test_quantized_gemm.py \
    -v -rs -p no:cacheprovider --durations=10 2>&1 | tee -a "$OUT/pytest_quant.log" || status=1
fi

bench() {  # bench NAME PRESET LAYERS WEIGHTS [FP8_GEMM]
  local name=$1 preset=$2 layers=$3 weights=$4 gemm=${5:-w8a16}
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 60 ]; then
    echo "== $name: skipped, ${left}s left of ${BUDGET_S}s" | tee -a "$OUT/bench_quant.log"; return
  fi
  echo "== $name: $preset, $layers layers, --weights $weights, FXFUSE_FP8_GEMM=$gemm (${left}s left)" | tee -a "$OUT/bench_quant.log"
  FXFUSE_FP8_GEMM=$gemm timeout "$left" python3 -m fxfuse --verbose bench model --tp 1 --preset "$preset" --layers "$layers" \
    --weights "$weights" --tokens 1,16 --batch 1,8 --backends eager,fxfuse --repeats 10 --iters 5 \
    --time-budget-s $((left - 30 < 90 ? left - 30 : 90)) --out-dir "$BENCH_DIR/$name" 2>&1 | tee -a "$OUT/bench_quant.log" || status=1
}

if [[ " $PARTS " == *" bench "* ]]; then
  bench deepseek-v3-bf16 deepseek-v3 4 bf16
  bench deepseek-v3-fp8 deepseek-v3 4 fp8
  bench kimi-k2.5-bf16 kimi-k2.5 2 bf16
  bench kimi-k2.5-int4 kimi-k2.5 2 int4
  bench deepseek-v3-fp8-w8a8 deepseek-v3 4 fp8 w8a8
  python3 - "$BENCH_DIR" >"$OUT/bench_summary.md" <<'PY'
import json, pathlib, sys
print("| run | weights | batch | tokens | backend | step ms | rel err vs eager | weights GB | peak GPU GB | status |")
print("|---|---|---:|---:|---|---:|---:|---:|---:|---|")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/*.json")):
    report = json.loads(path.read_text())
    for row in report["results"]:
        ms = "-" if row["step_ms"] is None else f"{row['step_ms']:.3f}"
        err = "-" if row["rel_err_vs_eager"] is None else f"{row['rel_err_vs_eager']:.2e}"
        print(f"| {path.parent.name} | {report['config'].get('weights')} | {row['batch']} | {row['tokens']} | {row['backend']} | {ms} | "
              f"{err} | {report.get('weight_gb', 0):.2f} | {report.get('peak_gpu_mem_gb') or 0:.2f} | {row['status']} |")
PY
  tar czf "$OUT/bench_results.tar.gz" -C "$(dirname "$BENCH_DIR")" "$(basename "$BENCH_DIR")"
  cat "$OUT/bench_summary.md"
fi
exit $status
