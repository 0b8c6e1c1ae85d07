"""What the PCIe path's second kernel costs per site inside a CUDA graph (one GPU, no communication).

On PCIe the fused op runs FlashInfer's IPC all-reduce, then fxfuse's add + RMSNorm (+ FP8) kernel. A one-kernel
design would drop that second launch and its read of the reduced row, but still do the epilogue's math. This
script times, in CUDA-graph replay, 200 back-to-back calls of:
- `empty`: a 1-element copy (a launch's floor inside a graph);
- `norm`: fxfuse's add + RMSNorm kernel;
- `norm+fp8`: add + RMSNorm + 1x128 FP8 group quantization (DeepSeek-V3's recipe).
Median over 7 replays of microseconds per call, the three interleaved (`fxfuse.bench.replay`).
Run: python measure_second_kernel.py > second_kernel.md
"""
import datetime
import sys

import torch

from fxfuse.bench.replay import replay_timings
from fxfuse.op.fp8_recipe import Fp8Recipe, scale_shape
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import add_rmsnorm_fp8_into
from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into

CALLS, REPLAYS = 200, 7
RECIPE = Fp8Recipe(scaling="per_group", group_size=128)


def main() -> None:
    hidden, dtype, device = 7168, torch.bfloat16, "cuda"
    props = torch.cuda.get_device_properties(0)
    print(f"# The PCIe path's second kernel per call in CUDA-graph replay: {props.name}\n")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"- command: `python {sys.argv[0]}`")
    print(f"- versions: torch {torch.__version__}, cuda {torch.version.cuda}")
    print(f"- hidden {hidden}, bfloat16; {CALLS} calls per graph, median of {REPLAYS} interleaved replays, us per call\n")
    print("| tokens | empty launch | add + RMSNorm | add + RMSNorm + FP8 1x128 |")
    print("|---:|---:|---:|---:|")
    one = torch.zeros(1, device=device)
    other = torch.zeros(1, device=device)
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
        reduced = torch.randn(tokens, hidden, device=device, dtype=dtype)
        residual = torch.randn_like(reduced)
        weight = torch.randn(hidden, device=device, dtype=dtype)
        residual_out, normed = torch.empty_like(reduced), torch.empty_like(reduced)
        quantized = torch.empty(tokens, hidden, device=device, dtype=torch.float8_e4m3fn)
        scales = torch.empty(scale_shape(reduced.shape, RECIPE), device=device, dtype=torch.float32)
        timings = replay_timings({
            "empty": lambda: other.copy_(one),
            "norm": lambda: add_rmsnorm_into(reduced, residual, weight, 1e-6, residual_out, normed),
            "fp8": lambda: add_rmsnorm_fp8_into(reduced, residual, weight, 1e-6, RECIPE, None, residual_out, None,
                                                quantized, scales),
        }, REPLAYS, CALLS)
        empty, norm, fp8 = (timings[name][0] for name in ("empty", "norm", "fp8"))
        print(f"| {tokens} | {empty:.2f} | {norm:.2f} | {fp8:.2f} |")


if __name__ == "__main__":
    main()
