"""Running the fused op: kernel registration per device, plans per call shape, workspaces, the public API.

`registration` gives the op's overloads their CPU and CUDA kernels (importing it is what makes
`torch.ops.fxfuse.*` runnable) and installs the C++ fallback; `cpu_kernel` is the CPU path (agreement,
gloo all-reduce, the reference arithmetic). On CUDA a call reads in one direction: `cuda_dispatch` looks
up the plan cached for its shape; `planning` makes a missing one (the decision of `fxfuse.op.decide`,
then the workspace it needs, then one agreement that every rank planned alike); `plans` launches it
(FlashInfer's kernels through `trtllm_kernels` / `pcie_kernels`, or NCCL, then `fxfuse.op.kernels`).
`workspace` owns the workspaces (`cuda_ipc`: device buffers shared over CUDA IPC) and `prepare` is the
public lifecycle API (`fxfuse.prepare`, `fxfuse.destroy_workspaces`). May import the contract, `decide`
and `kernels`, nothing else of fxfuse; FlashInfer is imported lazily, on the CUDA path only.
"""
