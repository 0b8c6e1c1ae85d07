"""The direct Triton launch's guards, on CPU: hook detection (profilers keep seeing launches) and the
row-block size the add-RMSNorm kernel is compiled for. The launch itself is checked on the GPU
(tests/gpu/test_fallback_gpu.py)."""

from __future__ import annotations

import pytest

from fxfuse.op.add_rmsnorm_kernel import next_power_of_2
from fxfuse.op.triton_launch import launch_hooks_installed

triton = pytest.importorskip("triton", reason="Triton is not installed")


@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_an_installed_launch_hook_sends_launches_through_the_jit(which):
    from triton import knobs

    assert not launch_hooks_installed()
    chain = getattr(knobs.runtime, which)

    def hook(metadata):
        return None

    chain.add(hook)
    try:
        assert launch_hooks_installed()
    finally:
        chain.remove(hook)
    assert not launch_hooks_installed()


def test_row_block_is_triton_next_power_of_two():
    for n in (1, 2, 3, 100, 1024, 4096, 5120, 7168, 16384, 65536):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
