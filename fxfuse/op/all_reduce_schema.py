"""The all-reduce-only op of tier (b): `torch.ops.fxfuse.all_reduce` and its in-place twin `all_reduce_`.

Schemas:
- `all_reduce(Tensor x, str group_name) -> Tensor`: the sum of `x` over the process group named
  `group_name`, in x's dtype, as a fresh contiguous tensor (never an alias of `x`);
- `all_reduce_(Tensor(a!) x, str group_name) -> ()`: the same sum written into `x`.

Where a site's norm feeds an epilogue the fused op cannot fold (`fxfuse.passes.site_tiers`), or an
all-reduce has no norm after it at all, the passes put this op where the all-reduce was and leave the
residual add, the norm and whatever follows to Inductor, which fuses them as it would have: the site
keeps Inductor's own code and gets the fastest all-reduce the machine has (FlashInfer's TensorRT-LLM
all-reduce on NVSwitch, its PCIe IPC all-reduce on PCIe, NCCL elsewhere: the fused op's decision
table, per call shape). For Inductor the functional op is rewritten to `auto_functionalized` of
`all_reduce_` (`fxfuse.passes.donate_allreduce_input`), so that Inductor's re-inplacing hands it `x`
itself where `x` is dead afterwards and a copy elsewhere: what it does for its own all-reduce. On the
NCCL plan the op then issues exactly Inductor's calls (`_c10d_functional.all_reduce_` and
`wait_tensor`, with the same copy where Inductor copies).

Importing this module defines both ops and their fake kernels; `fxfuse.op.runtime.registration`
registers what runs them (on CPU a gloo all-reduce, on CUDA the plans of `fxfuse.op.runtime.cuda_dispatch`).
"""

from __future__ import annotations

import torch

OP_NAME = "fxfuse::all_reduce"
IN_PLACE_OP_NAME = "fxfuse::all_reduce_"
SCHEMA = "(Tensor x, str group_name) -> Tensor"
IN_PLACE_SCHEMA = "(Tensor(a!) x, str group_name) -> ()"


def _fake_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Shapes only: a new contiguous tensor like `x` (works with SymInts)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_all_reduce_(x: torch.Tensor, group_name: str) -> None:
    """Shapes only: writes `x`, returns nothing."""


torch.library.define(OP_NAME, SCHEMA)
torch.library.register_fake(OP_NAME, _fake_all_reduce)
torch.library.define(IN_PLACE_OP_NAME, IN_PLACE_SCHEMA)
torch.library.register_fake(IN_PLACE_OP_NAME, _fake_all_reduce_)

#: The functional op, as the passes emit it.
all_reduce = torch.ops.fxfuse.all_reduce.default
#: Its in-place twin, which Inductor calls through `auto_functionalized` (output 1 is the reduced `x`).
all_reduce_ = torch.ops.fxfuse.all_reduce_.default
