"""fxfuse's own kernels for the fused op: the computations after the all-reduce, on buffers they are given.

The fused residual-add + RMSNorm Triton kernel (`add_rmsnorm_kernel`) and its FP8 form
(`add_rmsnorm_fp8_kernel`, `add_rmsnorm_fp8_triton`), launching a compiled Triton kernel without the
JIT's per-call work (`triton_launch`), and the NCCL fallback's per-call host work in C++
(`native_fallback.cpp`, its Python side `native_fallback`, compiled and loaded by `native_build`).
"""
