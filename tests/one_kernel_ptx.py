"""Compile the one-kernel PCIe path's Triton kernel for a CUDA GPU without one and write its PTX (Triton's compiler
and its bundled ptxas need no device): `python tests/one_kernel_ptx.py WORLD_SIZE SM FP8(0|1) OUT.ptx`.

Run by tests/test_one_kernel_compiles.py in a process without TRITON_INTERPRET. The kernel is specialized as the
launcher specializes it: bf16 rows of 7168 (a DeepSeek-V3 row) with a residual, the norm epilogue or the FP8 one
(1x128 groups), 16-byte aligned pointers and hidden size, 8 warps.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fxfuse.op.kernels.one_shot_triton import one_shot_all_reduce_rows as kernel

POINTERS = {**{f"buffer{i}": "*i16" for i in range(8)}, "own": "*i16", "flags_ptr": "*i32", "x_ptr": "*bf16",
            "residual_ptr": "*bf16", "weight_ptr": "*bf16", "residual_out_ptr": "*bf16", "normed_ptr": "*bf16",
            "quantized_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "static_scale_ptr": "*i32"}
INTEGERS = ("tokens", "hidden", "capacity", "programs", "rank", "groups")
FLOATS = ("eps", "min_amax", "divisor", "min_scale", "clamp_bound")


def main(world_size: int, sm: int, fp8: bool, out: str) -> None:
    """Compile and write the PTX (ptxas's cubin must come out too)."""
    names = kernel.arg_names
    constexprs = dict(WORLD_SIZE=world_size, EPILOGUE=2 if fp8 else 1, HAS_RESIDUAL=True, STORE_NORMED=not fp8,
                      SCALING=0, SCALE_ROUNDING=0, ROWS=64 if fp8 else 1, COLS=128 if fp8 else 8192, WEIGHT_IN_FP32=False,
                      WEIGHT_OFFSET=0.0, POWER_OF_TWO=0, BOUND_AFTER_POWER_OF_TWO=False, RECIPROCAL=False, SATURATE=True,
                      CAST_SATURATES=True, LIBDEVICE=True)
    signature = {n: POINTERS.get(n) or ("i32" if n in INTEGERS else "fp32" if n in FLOATS else "constexpr") for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in POINTERS or n == "hidden"})
    compiled = triton.compile(source, target=GPUTarget("cuda", sm, 32), options={"num_warps": 8})
    if not compiled.asm.get("cubin"):
        raise SystemExit("ptxas gave no cubin")
    with open(out, "w") as f:
        f.write(compiled.asm["ptx"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4])
