"""All-reduce + residual add + RMSNorm (+ FP8) in ONE kernel over peer-mapped buffers: the one-kernel PCIe path.

`all_reduce_norm_into(peers, x, ..., epilogue)` sums contiguous [tokens, hidden] `x` over the ranks whose
receive buffers `peers` describes (`PeerBuffers`: every rank's buffer as this process maps it, this rank's
flags in device memory, the buffer's rows per slot) and runs, in the same launch, one of three
epilogues on the sum rounded to x's dtype:
- `Epilogue.ALL_REDUCE`: the sum itself, into `normed` (the all-reduce-only op);
- `Epilogue.NORM`: what `fxfuse.op.kernels.add_rmsnorm_kernel.add_rmsnorm_into` computes, every norm variant
  (weight offset, weight in float32, float32 weight, float32 residual stream);
- `Epilogue.FP8`: what `fxfuse.op.kernels.add_rmsnorm_fp8_kernel.add_rmsnorm_fp8_into` computes, every recipe.
The epilogue is the same Triton code those kernels run (`add_rmsnorm_tile`, `quantize_tile`). The protocol,
and why it is safe under CUDA graphs, is in `fxfuse.op.kernels.one_shot_triton`. The sum is taken in float32
in rank order on every rank, so every rank gets the same bits; small-integer data sums exactly, as NCCL's
and FlashInfer's all-reduces do.

Every rank of the group must launch the same sequence of calls with the same token counts (the op's plans
agree on each shape) on one stream at a time; a launch runs at most one program per SM (`programs`), so
that every program is resident and waits only on peers. Compiled kernels are launched directly after the
first JIT call, as the norm kernels are (`fxfuse.op.kernels.triton_launch`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from fxfuse.op.fp8_recipe import Fp8Limits, Fp8Recipe
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import recipe_terms
from fxfuse.op.kernels.add_rmsnorm_kernel import POINTER_ALIGNMENT, num_warps_for
from fxfuse.op.kernels.triton_launch import DirectLaunch, launch_hooks_installed

#: Flags per rank: generation, arrivals, rows received by each of the three generations.
FLAG_WORDS = 5
#: Generations of the receive buffer (see fxfuse.op.kernels.one_shot_triton).
GENERATIONS = 3
#: The recipe the FP8 arguments of a launch without FP8 are filled from (unused by the kernel then).
_NO_FP8 = Fp8Recipe(scaling="per_row")

_DIRECT: dict[tuple, DirectLaunch] = {}


class Epilogue(enum.IntEnum):
    """What the kernel does with the reduced rows (its EPILOGUE constexpr)."""

    ALL_REDUCE = 0
    NORM = 1
    FP8 = 2


#: Most ranks the kernel takes (it has one pointer argument per rank's buffer).
MAX_WORLD_SIZE = 8


@dataclass(frozen=True)
class DeviceAddress:
    """A device pointer the kernel takes as a pointer argument (Triton reads `data_ptr()` and `dtype`): a peer's
    buffer mapped over CUDA IPC, which no torch tensor owns."""

    address: int
    dtype: torch.dtype = torch.int16

    def data_ptr(self) -> int:
        """The address."""
        return self.address


@dataclass(frozen=True)
class PeerBuffers:
    """What one launch needs of a workspace: every rank's receive buffer as this process maps it (`buffers`, in
    rank order: torch tensors or `DeviceAddress`es of 16-bit elements), this rank's `flags` (int32[FLAG_WORDS] on
    this GPU, zero when made), and the buffers' shape."""

    buffers: tuple
    flags: torch.Tensor
    rank: int
    capacity: int  # rows per (generation, sender) slot
    hidden: int

    @property
    def world_size(self) -> int:
        """Ranks of the group."""
        return len(self.buffers)

    def pointer_arguments(self) -> tuple:
        """The kernel's buffer arguments: this rank's, then one per rank up to MAX_WORLD_SIZE (the rest unused)."""
        own = self.buffers[self.rank]
        return (own, *self.buffers, *(own,) * (MAX_WORLD_SIZE - self.world_size))


def receive_buffer_bytes(world_size: int, capacity: int, hidden: int) -> int:
    """Bytes of one rank's receive buffer: 3 generations x world_size senders x capacity rows x hidden 16-bit elements."""
    return GENERATIONS * world_size * capacity * hidden * 2


@dataclass(frozen=True)
class Fp8Outputs:
    """The FP8 epilogue's recipe, its static scale (None when dynamic), its limits and its outputs."""

    recipe: Fp8Recipe
    static_scale: torch.Tensor | None
    quantized: torch.Tensor
    scales: torch.Tensor
    limits: Fp8Limits = Fp8Limits()


@functools.cache
def _kernel():
    from fxfuse.op.kernels.one_shot_triton import one_shot_all_reduce_rows

    return one_shot_all_reduce_rows


@functools.cache
def _terms_without_fp8(hidden: int) -> tuple:
    """`recipe_terms` of a launch without FP8 (its FP8 arguments unused; a per-row recipe's tile is the whole row),
    once per row width."""
    return recipe_terms(_NO_FP8, hidden, Fp8Limits())


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def all_reduce_norm_into(
    peers: PeerBuffers, x: torch.Tensor, epilogue: Epilogue, residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None, eps: float = 0.0, residual_out: torch.Tensor | None = None,
    normed: torch.Tensor | None = None, weight_offset: float = 0.0, weight_in_fp32: bool = False,
    fp8: Fp8Outputs | None = None, programs: int | None = None, compile_only: bool = False,
) -> None:
    """One launch: x summed over the group, then `epilogue` (see the module docstring), on the current stream.

    `x` is contiguous [tokens, hidden] of bfloat16 or float16 with 1 <= tokens <= peers.capacity and
    hidden == peers.hidden (the workspace bounds the width: `fxfuse.op.decide.policy.ONE_KERNEL_MAX_HIDDEN`); the
    outputs are contiguous and shaped like x (scales as `fp8_recipe.scale_shape`); `normed` may be None only for
    the FP8 epilogue (nothing reads the norm).
    `programs` (default: one per SM, at most one per row) must leave every program resident. Raises
    ValueError for a shape the workspace cannot hold (on every rank alike, since the shapes agree).
    `compile_only` compiles the kernel for this call without launching it (a launch is a collective): what
    the plans do outside capture, so that a first call during capture does not compile.
    """
    tokens, hidden = x.shape
    if not 2 <= peers.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"the one-kernel all-reduce runs 2-{MAX_WORLD_SIZE} ranks, not {peers.world_size}")
    if not 1 <= tokens <= peers.capacity or hidden != peers.hidden:
        raise ValueError(f"the one-kernel all-reduce holds 1-{peers.capacity} rows of {peers.hidden}; got {tokens} x {hidden}")
    device = x.device.index if x.is_cuda else -1
    programs = min(tokens, programs or (_multiprocessors(device) if x.is_cuda else tokens))
    if fp8 is None:
        scalars, (rows, cols), recipe_constexprs = _terms_without_fp8(hidden)
    else:
        scalars, (rows, cols), recipe_constexprs = recipe_terms(fp8.recipe, hidden, fp8.limits)
    store_normed = normed is not None
    pointers = (
        *peers.pointer_arguments(), peers.flags, x, x if residual is None else residual, x if weight is None else weight,
        x if residual_out is None else residual_out, normed if store_normed else x,
        fp8.quantized if fp8 else x, fp8.scales if fp8 and fp8.scales.numel() else x,
        fp8.static_scale if fp8 and fp8.static_scale is not None else peers.flags,
    )
    args = (*pointers, tokens, hidden, peers.capacity, programs, peers.rank, scalars[0], float(eps), *scalars[1:])
    constexprs = (peers.world_size, int(epilogue), residual is not None, store_normed, *recipe_constexprs[:2], rows, cols,
                  bool(weight_in_fp32), float(weight_offset), *recipe_constexprs[2:], x.is_cuda)
    key = (device, hidden, constexprs, tuple(t.dtype for t in pointers))  # the kernel specializes on no other integer
    aligned = all(t.data_ptr() % POINTER_ALIGNMENT == 0 for t in pointers)
    if compile_only:
        _kernel().warmup(*args, *constexprs, grid=(programs,), num_warps=num_warps_for(rows * cols))
        return
    direct = _DIRECT.get(key)
    if direct is not None and aligned and x.is_cuda and not launch_hooks_installed():
        direct(programs, device, args)
        return
    compiled = _kernel()[(programs,)](*args, *constexprs, num_warps=num_warps_for(rows * cols))
    if aligned and x.is_cuda and key not in _DIRECT:
        _DIRECT[key] = DirectLaunch(compiled, constexprs)
