"""Running the fused op: kernel registration, the CPU kernel, the CUDA dispatch and its plans, workspaces, the API.

`registration` gives the op's overloads their CPU and CUDA kernels (importing it is what makes
`torch.ops.fxfuse.*` runnable) and installs the C++ fallback; `cpu_kernel` is the CPU path;
`cuda_dispatch` picks and caches a plan per call shape and runs it (FlashInfer's kernels through
`trtllm_kernels` / `pcie_kernels`, or NCCL, then `fxfuse.op.kernels`); `workspace` owns the workspaces
(`cuda_ipc`: device buffers shared over CUDA IPC) and `prepare` is the public lifecycle API
(`fxfuse.prepare`, `fxfuse.destroy_workspaces`).
"""
