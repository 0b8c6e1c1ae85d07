#!/usr/bin/env bash
# Device call: the compiled model under CUDA graphs on the TensorRT-LLM path (waits on FlashInfer's ~5-minute
# JIT on a fresh machine), after the collective-placement fix (927ad10).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl072s/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
echo "install at $SECONDS s"
timeout -s INT $((585 - SECONDS)) python3 -m pytest -m gpu tests/gpu/test_compiled_model_cuda_graph.py -k trtllm -v -rs \
  -p no:cacheprovider -o faulthandler_timeout=500 --durations=5 > "$OUT/pytest_graph_trtllm.log" 2>&1
echo "graph trtllm rc=$? at $SECONDS s"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$OUT/pytest_graph_trtllm.log" | head -20
