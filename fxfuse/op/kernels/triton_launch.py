"""Launching an already compiled Triton kernel without the JIT's per-call work.

`JITFunction[grid](*args)` binds the arguments, computes their specialization key and looks the
compiled kernel up on every call; for a small kernel that host work costs more than the launch
itself. `DirectLaunch` keeps the `CompiledKernel` the first JIT call returned and calls its launcher
with the same arguments in the same order (runtime arguments, then the constexprs, as the JIT
passes them; this calling convention is shared by Triton 3.2 through 3.9). The caller must only use
it for calls the JIT would have specialized identically (same device, dtypes, integer values it
specializes on, pointer alignment).

Profilers that install Triton launch hooks (`knobs.runtime.launch_enter_hook`) still see every
launch: while hooks are installed, callers go through the JIT (`launch_hooks_installed`).

`driver_launch(compiled, runtime_types)` describes a compiled kernel for a launch with the CUDA
driver's `cuLaunchKernel` from C++ (the fused op's C++ fallback): its function handle, threads per
program and shared memory. It reads the kernel's parameter list from its PTX, the ground truth of
what the launch must pass, and answers only for the plain case it can vouch for (the expected runtime
parameters followed by at most two scratch pointers Triton passes as null when their size is 0, one
CTA per program, no cooperative or programmatic-dependent launch); otherwise None.
"""

from __future__ import annotations

import functools
import re

import torch

#: Scratch pointers Triton appends to a kernel's parameters (global, then profile scratch; null when unused).
MAX_SCRATCH_POINTERS = 2
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)")


class DirectLaunch:
    """Calls one compiled Triton kernel's launcher directly with a 1-D grid."""

    def __init__(self, compiled, constexprs: tuple):
        self._launcher = compiled.run  # first, as it loads the module when that has not happened yet
        self._function = compiled.function
        self._packed_metadata = compiled.packed_metadata
        self._constexprs = constexprs

    def __call__(self, programs: int, device: int, args: tuple) -> None:
        """Launch `programs` programs on the current stream of CUDA device `device`."""
        stream = torch._C._cuda_getCurrentRawStream(device)
        self._launcher(programs, 1, 1, stream, self._function, self._packed_metadata, None, None, None,
                       *args, *self._constexprs)


def launch_hooks_installed() -> bool:
    """Whether some tool installed a Triton launch hook (then launches must go through the JIT)."""
    runtime = _runtime_knobs()
    return _installed(runtime.launch_enter_hook) or _installed(runtime.launch_exit_hook)


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def _installed(hook) -> bool:
    # Triton >= 3.6 holds hooks in a HookChain (empty: none installed); earlier ones hold None or a function.
    return hook is not None and bool(getattr(hook, "calls", True))


def ptx_parameter_types(ptx: str, kernel_name: str) -> list[str]:
    """The PTX types (`u64`, `u32`, `f32`, ...) of the entry `kernel_name`'s parameters, in order."""
    start = ptx.find(f".entry {kernel_name}(")
    if start < 0:
        raise ValueError(f"no entry {kernel_name!r} in the PTX")
    return _PTX_PARAM.findall(ptx[start:ptx.index(")", start)])


def driver_launch(compiled, runtime_types: list[str]) -> tuple[int, int, int] | None:
    """(CUfunction handle, threads per program, shared bytes) to launch `compiled` with `cuLaunchKernel`
    and parameters `runtime_types` followed by null scratch pointers; None if it needs anything else."""
    metadata = compiled.metadata
    plain = (getattr(metadata, "num_ctas", 1) == 1 and not getattr(metadata, "launch_cooperative_grid", False)
             and not getattr(metadata, "launch_pdl", False) and not getattr(metadata, "global_scratch_size", 0)
             and not getattr(metadata, "profile_scratch_size", 0) and tuple(getattr(metadata, "cluster_dims", (1, 1, 1))) in ((1, 1, 1), ()))
    ptx = getattr(compiled, "asm", {}).get("ptx")
    if not plain or ptx is None:
        return None
    types = ptx_parameter_types(ptx, metadata.name)
    scratch = types[len(runtime_types):]
    if types[:len(runtime_types)] != runtime_types or len(scratch) > MAX_SCRATCH_POINTERS or set(scratch) - {"u64"}:
        return None
    compiled.run  # loads the module (and so the function handle) where that has not happened yet
    return int(compiled.function), getattr(metadata, "warp_size", 32) * metadata.num_warps, int(metadata.shared)
