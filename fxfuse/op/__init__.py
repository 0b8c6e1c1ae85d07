"""The fused collective+norm op `fxfuse::allreduce_residual_rmsnorm` and every implementation of it.

Here, the op's contract: `schema` defines the op and its fake kernel (`fp8_schema` its FP8 variant, whose
quantization `fp8_recipe` describes; `all_reduce_schema` the all-reduce-only op of tier (b), which the
same decisions and plans run); `reference` holds the arithmetic every kernel reproduces. Below
it, one sub-package per concern, and a call goes through them in one direction: `decide` says which
implementation runs a call shape, from values every rank agrees on; `runtime` makes the plan for that
shape once (the decision, its workspace, one agreement round), caches it and launches it, on
fxfuse's own kernels (`kernels`: Triton, the C++ fallback) or FlashInfer's. `runtime` also registers
the op's kernels with torch and holds the public API (`fxfuse.prepare`, `fxfuse.destroy_workspaces`).
The contract imports none of the sub-packages; `decide` and `kernels` import only the contract
(`kernels.native_build` also `decide.environment`, for how FXFUSE_* variables are read); nothing in
fxfuse.op imports the rest of fxfuse. tests/test_layout.py checks these rules.
Importing this package registers nothing and imports neither CUDA code nor FlashInfer.
"""
