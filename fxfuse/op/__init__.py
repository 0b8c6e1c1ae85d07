"""The fused collective+norm op `fxfuse::allreduce_residual_rmsnorm` and every implementation of it.

`schema` defines and registers the op (CPU reference kernel, fake kernel, CUDA kernel entry);
`reference` holds the arithmetic every kernel reproduces; `cuda_dispatch` picks and caches what runs
on CUDA (`policy` decides from `settings`, `thresholds`, `topology` and the FlashInfer gates of
`flashinfer_version`, all agreed by the ranks in `group_config`); `trtllm_kernels`, `pcie_kernels` and
`add_rmsnorm_kernel` are the implementations (`native_fallback`, built by `native_build`, runs the
NCCL one's per-call work in C++); `workspace` and `cuda_ipc` own their device memory;
`capability` answers at compile time whether anything fused can run; `prepare` is the public API.
Importing this package registers nothing and imports neither CUDA code nor FlashInfer.
"""
