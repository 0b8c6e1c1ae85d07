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
"""

from __future__ import annotations

import torch


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
    from triton import knobs

    runtime = knobs.runtime
    return _installed(runtime.launch_enter_hook) or _installed(runtime.launch_exit_hook)


def _installed(hook) -> bool:
    # Triton >= 3.6 holds hooks in a HookChain (empty: none installed); earlier ones hold None or a function.
    return hook is not None and bool(getattr(hook, "calls", True))
