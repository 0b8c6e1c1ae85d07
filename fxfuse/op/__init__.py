"""The fused collective+norm op `fxfuse::allreduce_residual_rmsnorm` and every implementation of it.

`schema` defines and registers the op (CPU reference kernel, fake kernel, CUDA kernel entry);
`reference` holds the arithmetic every kernel reproduces; `cuda_dispatch` picks what runs on CUDA;
`policy`, `modes` and `thresholds` make that choice from values equal on every rank; `fused_path`,
`trtllm_kernels` and `workspace` run FlashInfer's TensorRT-LLM kernel and own its workspaces.
Importing this package registers nothing and imports neither CUDA code nor FlashInfer.
"""
