"""fxfuse's own kernels for the fused op: the computations after the all-reduce, on buffers they are given.

The fused residual-add + RMSNorm Triton kernel (`add_rmsnorm_kernel`) and its FP8 form
(`add_rmsnorm_fp8_kernel`, kernel body in `add_rmsnorm_fp8_triton`), launching a compiled Triton kernel
without the JIT's per-call work (`triton_launch`), and the NCCL fallback's per-call host work in C++
(`native_fallback.cpp`, its Python side `native_fallback`, compiled and loaded by `native_build`). They
neither decide, allocate workspaces nor talk to other ranks. May import the op's contract
(`fxfuse.op.schema`, `fp8_schema`, `fp8_recipe`, `reference`) and, from `fxfuse.op.decide`, only
`environment` (`native_build` reads FXFUSE_NATIVE / FXFUSE_NATIVE_CACHE the way every FXFUSE_*
variable is read); never the runtime. FlashInfer's kernels are driven from `fxfuse.op.runtime`, since
they come with workspaces that the ranks create together.
"""
