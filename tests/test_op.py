"""The fused op `fxfuse::allreduce_residual_rmsnorm`: schema, fake kernel, reference numerics on two
gloo ranks, no aliasing, and the CUDA kernel's FlashInfer hook / NCCL fallback (exercised on CPU)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from toy_graphs import fake_process_group

from fxfuse.op import cuda_dispatch
from fxfuse.op.schema import add_rmsnorm, allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps

SCHEMA = (
    "fxfuse::allreduce_residual_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name)"
    " -> (Tensor normed, Tensor residual_out)"
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((5, 32), (2, 3, 32))


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def test_schema_is_the_contract():
    assert str(allreduce_residual_rmsnorm._schema) == SCHEMA


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_opcheck(group, with_residual):
    """Schema, autograd registration, fake kernel and AOT dispatch agree with the CPU kernel."""
    residual = torch.randn(3, 16) if with_residual else None
    torch.library.opcheck(allreduce_residual_rmsnorm, (torch.randn(3, 16), residual, torch.randn(16), 1e-6, group.group_name))


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_tensor_eps_overload_matches_float_overload(group, with_residual):
    """`tensor_eps` (eps as a 0-dim CPU tensor, as dynamic=True graphs carry it) = the float overload."""
    x, weight = torch.randn(3, 16), torch.randn(16)
    residual = torch.randn(3, 16) if with_residual else None
    eps = torch.tensor(1e-2, dtype=torch.float64)
    torch.library.opcheck(allreduce_residual_rmsnorm_tensor_eps, (x, residual, weight, eps, group.group_name))
    torch.testing.assert_close(
        allreduce_residual_rmsnorm_tensor_eps(x, residual, weight, eps, group.group_name),
        allreduce_residual_rmsnorm(x, residual, weight, 1e-2, group.group_name),
        rtol=0,
        atol=0,
    )


def test_fake_kernel_traces_symbolic_token_counts(group):
    from torch.fx.experimental.proxy_tensor import make_fx

    def call(x, residual, weight):
        return allreduce_residual_rmsnorm(x, residual, weight, 1e-6, group.group_name)

    gm = make_fx(call, tracing_mode="symbolic")(torch.randn(7, 16), torch.randn(7, 16), torch.randn(16))
    (fused,) = gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm)
    normed, residual_out = fused.meta["val"]
    assert isinstance(normed.shape[0], torch.SymInt) and normed.shape[1] == 16
    assert residual_out.shape == normed.shape


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_outputs_never_alias_inputs(group, with_residual):
    x, weight = torch.randn(4, 16), torch.randn(16)
    residual = torch.randn(4, 16) if with_residual else None
    inputs = [t for t in (x, residual, weight) if t is not None]
    outputs = allreduce_residual_rmsnorm(x, residual, weight, 1e-6, group.group_name)
    pointers = {t.untyped_storage().data_ptr() for t in inputs}
    assert all(out.untyped_storage().data_ptr() not in pointers for out in outputs)
    assert outputs[0].untyped_storage().data_ptr() != outputs[1].untyped_storage().data_ptr()


def _reference_cases():
    return [(dtype, shape, with_residual) for dtype in DTYPES for shape in SHAPES for with_residual in (True, False)]


def _op_on_rank(ctx):
    """Call the op for every case with rank-specific x; return inputs and outputs for the parent."""
    results = []
    for dtype, shape, with_residual in _reference_cases():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + ctx.rank)).to(dtype)
        common = torch.Generator().manual_seed(99)
        residual = torch.randn(shape, generator=common).to(dtype) if with_residual else None
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=common)).to(dtype)
        normed, residual_out = allreduce_residual_rmsnorm(x, residual, weight, 1e-5, ctx.group.group_name)
        results.append((x, residual, weight, normed, residual_out))
    return results


@pytest.mark.slow
def test_reference_numerics_on_two_gloo_ranks():
    """all_reduce in the input dtype, add rounded to it, fp32 norm, cast back, times weight:
    bit-identical to that arithmetic, identical on both ranks, and close to a float64 evaluation."""
    from fxfuse.runner.launch import run_on_ranks

    rank0, rank1 = run_on_ranks(_op_on_rank, 2)
    for (dtype, shape, _), case0, case1 in zip(_reference_cases(), rank0, rank1):
        (x0, residual, weight, normed, residual_out), (x1, *_, normed1, residual_out1) = case0, case1
        torch.testing.assert_close((normed1, residual_out1), (normed, residual_out), rtol=0, atol=0)
        assert normed.dtype == residual_out.dtype == dtype and normed.shape == residual_out.shape == shape

        expected_normed, expected_residual = add_rmsnorm(x0 + x1, residual, weight, 1e-5)
        torch.testing.assert_close((normed, residual_out), (expected_normed, expected_residual), rtol=0, atol=0)

        exact = x0.double() + x1.double() + (0 if residual is None else residual.double())
        exact_normed = exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        tolerance = 1e-5 if dtype == torch.float32 else 3 * torch.finfo(dtype).eps
        torch.testing.assert_close(normed.double(), exact_normed, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------- CUDA kernel logic, run on CPU tensors


def _cuda_kernel_args(group):
    return torch.randn(4, 16), torch.randn(4, 16), torch.randn(16), 1e-6, group.group_name


def test_cuda_kernel_returns_what_flashinfer_hook_returns(group, monkeypatch):
    sentinel = (torch.zeros(4, 16), torch.ones(4, 16))
    calls = []

    def try_fused(*args):
        calls.append(args)
        return sentinel

    hook = types.SimpleNamespace(try_allreduce_residual_rmsnorm=try_fused)
    monkeypatch.setattr(cuda_dispatch, "flashinfer_hook", lambda: hook)
    args = _cuda_kernel_args(group)
    assert cuda_dispatch.allreduce_residual_rmsnorm_cuda(*args) is sentinel
    assert calls == [args]


@pytest.mark.parametrize("hook", [None, types.SimpleNamespace(try_allreduce_residual_rmsnorm=lambda *a: None)],
                         ids=["no_flashinfer_module", "flashinfer_declines"])
def test_cuda_kernel_falls_back_to_collective_plus_reference(group, monkeypatch, hook):
    monkeypatch.setattr(cuda_dispatch, "flashinfer_hook", lambda: hook)
    x, residual, weight, eps, name = _cuda_kernel_args(group)
    normed, residual_out = cuda_dispatch.allreduce_residual_rmsnorm_cuda(x, residual, weight, eps, name)
    # the fake group's all-reduce leaves x as it is
    torch.testing.assert_close((normed, residual_out), add_rmsnorm(x, residual, weight, eps), rtol=0, atol=0)


def test_flashinfer_hook_is_optional(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cuda_dispatch.importlib, "import_module", missing)
    cuda_dispatch.flashinfer_hook.cache_clear()
    try:
        assert cuda_dispatch.flashinfer_hook() is None
    finally:
        cuda_dispatch.flashinfer_hook.cache_clear()


def test_broken_flashinfer_hook_fails_loudly(monkeypatch):
    """A hook module that exists but cannot import a dependency is an error, not a silent fallback."""

    def broken(name):
        raise ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")

    monkeypatch.setattr(cuda_dispatch.importlib, "import_module", broken)
    cuda_dispatch.flashinfer_hook.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match="some_dependency"):
            cuda_dispatch.flashinfer_hook()
    finally:
        cuda_dispatch.flashinfer_hook.cache_clear()


@pytest.mark.slow
def test_cpu_paths_never_import_flashinfer():
    """Importing the op, its CUDA kernel module and the backend loads no FlashInfer code."""
    code = (
        "import sys, fxfuse.op.schema, fxfuse.op.cuda_dispatch, fxfuse.backend\n"
        "loaded = [m for m in sys.modules if m.startswith('flashinfer') or m == 'fxfuse.op.fused_path']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
