"""The direct Triton launch's guards, on CPU: hook detection (profilers keep seeing launches), the
row-block size the add-RMSNorm kernel is compiled for, and what `driver_launch` vouches for before the
C++ fallback may launch a compiled kernel itself (its PTX parameters, a plain launch). The launch itself is checked on the GPU
(tests/gpu/test_fallback_gpu.py)."""

from __future__ import annotations

import pytest

from fxfuse.op.kernels.add_rmsnorm_kernel import next_power_of_2
from fxfuse.op.kernels.triton_launch import launch_hooks_installed

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


# The entry of the add-RMSNorm kernel's PTX as Triton 3.9 writes it for sm_90 (the two last
# parameters are the global and profile scratch pointers).
PTX = """
.visible .entry add_rmsnorm_rows(
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_0,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_1,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_2,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_3,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_4,
	.param .u32 add_rmsnorm_rows_param_5,
	.param .f32 add_rmsnorm_rows_param_6,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_7,
	.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_8
)
.reqntid 128
{
"""


class _Compiled:
    """What `driver_launch` reads of a Triton `CompiledKernel`."""

    def __init__(self, ptx=PTX, **metadata):
        from types import SimpleNamespace

        fields = dict(name="add_rmsnorm_rows", num_warps=4, shared=16, num_ctas=1, launch_cooperative_grid=False,
                      launch_pdl=False, global_scratch_size=0, profile_scratch_size=0)
        self.metadata = SimpleNamespace(**{**fields, **metadata})
        self.asm = {"ptx": ptx}
        self.function = 0xABC
        self.run = None


def test_ptx_parameter_types_read_the_entry():
    from fxfuse.op.kernels.add_rmsnorm_kernel import PTX_PARAMETERS
    from fxfuse.op.kernels.triton_launch import ptx_parameter_types

    assert ptx_parameter_types(PTX, "add_rmsnorm_rows") == PTX_PARAMETERS + ["u64", "u64"]
    with pytest.raises(ValueError, match="no entry 'other'"):
        ptx_parameter_types(PTX, "other")


def test_driver_launch_answers_only_for_the_plain_launch():
    from fxfuse.op.kernels.add_rmsnorm_kernel import PTX_PARAMETERS
    from fxfuse.op.kernels.triton_launch import driver_launch

    assert driver_launch(_Compiled(), PTX_PARAMETERS) == (0xABC, 128, 16)
    without_scratch = PTX.replace(",\n\t.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_7", "").replace(
        ",\n\t.param .u64 .ptr .global .align 1 add_rmsnorm_rows_param_8", "")
    assert driver_launch(_Compiled(without_scratch), PTX_PARAMETERS) == (0xABC, 128, 16)
    # a specialized-away or retyped parameter, an unknown extra one, or a launch that is not plain: no answer
    assert driver_launch(_Compiled(PTX.replace(".u32 add", ".u64 add")), PTX_PARAMETERS) is None
    assert driver_launch(_Compiled(PTX.replace("param_8\n", "param_8,\n\t.param .u32 extra\n")), PTX_PARAMETERS) is None
    for field, value in (("num_ctas", 2), ("launch_cooperative_grid", True), ("launch_pdl", True),
                         ("global_scratch_size", 64), ("profile_scratch_size", 8)):
        assert driver_launch(_Compiled(**{field: value}), PTX_PARAMETERS) is None, field
    assert driver_launch(_Compiled(ptx=None), PTX_PARAMETERS) is None
