"""The fused collective+norm op `fxfuse::allreduce_residual_rmsnorm` and every implementation of it.

Here, the op's contract: `schema` defines the op and its fake kernel (and `fp8_schema` its FP8 variant,
whose quantization `fp8_recipe` describes); `reference` holds the arithmetic every kernel reproduces.
Below it, one sub-package per concern: `decide` (which implementation runs a call, from values every
rank agrees on), `kernels` (fxfuse's own kernels and the C++ fallback) and `runtime` (the kernels'
registration, the CPU kernel, the CUDA dispatch and its plans, workspaces, and `prepare`, the public
API). The contract imports none of them.
Importing this package registers nothing and imports neither CUDA code nor FlashInfer.
"""
