"""GPU tests of the fused op's fallback (no FlashInfer needed): the Triton add-RMSNorm kernel against the
reference arithmetic, and the op on a one-rank NCCL group (where it always takes its NCCL plan),
eagerly, donated, and captured in a CUDA graph replayed on fresh input (the first call of a shape
decided in Python, the later ones run by the C++ fallback, bit for bit the same); plus a block compiled by
Inductor with the site fused, whose Inductor code donates the producer's buffer, under CUDA graphs;
and a fused block compiled without `fxfuse.prepare`, for which the backend installs the C++ fallback; and
a small `fxfuse bench fallback` sweep over every quantization kind and both shape modes.
Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch
from flashinfer_gpu import CUDA_GPU_MARKS, EPS, inputs, reference, rel_errs

from fxfuse.runner.launch import run_on_ranks

pytestmark = CUDA_GPU_MARKS
TOLERANCE = 1e-2  # relative L2 vs fp32; bf16 rounding alone gives about 3e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden", [100, 256, 4096, 5120, 7168, 16384])
def test_triton_add_rmsnorm_matches_the_reference_arithmetic(dtype, hidden):
    from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
    from fxfuse.op.reference import add_rmsnorm

    for tokens in (1, 7, 300):
        g = torch.Generator(device="cuda").manual_seed(tokens + hidden)
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
        residual = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
        for res in (residual, None):
            normed, residual_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            add_rmsnorm_into(x, res, weight, EPS, residual_out, normed)
            expected_normed, expected_residual = add_rmsnorm(x, res, weight, EPS)
            torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
            # one rounding step of the dtype at most: the fp32 sum's order differs from torch's
            step = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
            torch.testing.assert_close(normed, expected_normed, rtol=step, atol=step * expected_normed.abs().max().item())


def test_direct_launch_matches_the_jit_launch_and_skips_misaligned_pointers():
    """After the first (JIT) launch of a key, launches go straight to the compiled kernel: same bits as
    the JIT gives; a misaligned pointer (which the compiled kernel was not specialized for) goes back
    through the JIT and is still right."""
    from fxfuse.op.kernels import add_rmsnorm_kernel as kernel
    from fxfuse.op.reference import add_rmsnorm

    hidden, dtype = 3072, torch.bfloat16
    key = (torch.cuda.current_device(), hidden, True) + (dtype,) * 5 + (0.0, False)  # the plain norm
    kernel._DIRECT.pop(key, None)
    g = torch.Generator(device="cuda").manual_seed(5)
    x, residual = (torch.randn(9, hidden, device="cuda", generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    outputs = []
    for _ in range(2):  # the JIT launch, then the direct one
        normed, residual_out = torch.empty_like(x), torch.empty_like(x)
        kernel.add_rmsnorm_into(x, residual, weight, EPS, residual_out, normed)
        outputs.append((normed, residual_out))
        assert key in kernel._DIRECT
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    padded = torch.empty(9 * hidden + 1, device="cuda", dtype=dtype)
    shifted = padded[1:].view(9, hidden)  # 2-byte offset: not 16-byte aligned
    shifted.copy_(residual)
    normed, residual_out = torch.empty_like(x), torch.empty_like(x)
    kernel.add_rmsnorm_into(x, shifted, weight, EPS, residual_out, normed)
    expected_normed, expected_residual = add_rmsnorm(x, residual, weight, EPS)
    torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, outputs[0][0], rtol=0, atol=0)


def one_rank_checks(ctx) -> dict:
    """The op on a one-rank NCCL group: eager, donated, and CUDA-graph replay on fresh input."""
    import fxfuse
    from fxfuse.op.kernels.native_fallback import calls_by_reason, native_installed
    from fxfuse.op.runtime import cuda_dispatch
    from fxfuse.op.schema import (
        allreduce_residual_rmsnorm,
        allreduce_residual_rmsnorm_donate_x,
        allreduce_residual_rmsnorm_tensor_eps,
    )

    device, name, hidden = torch.device("cuda", torch.cuda.current_device()), ctx.group.group_name, 7168
    report = {"ready": fxfuse.prepare(ctx.group, hidden, torch.bfloat16, max_tokens=256), "native": native_installed()}
    report["eager"] = {}
    for tokens in (1, 16, 256, 1024):  # 1024: beyond the prepared size, the same NCCL plan
        x, xs, residual, weight = inputs(0, 1, tokens, 0, device, hidden)
        kept = x.clone()
        out = allreduce_residual_rmsnorm(x, residual, weight, EPS, name)  # Python decides; later calls run in C++
        donated = allreduce_residual_rmsnorm_donate_x(x.clone(), residual, weight, EPS, name)
        tensor_eps = allreduce_residual_rmsnorm_tensor_eps(x, residual, weight, torch.tensor(EPS, dtype=torch.float64), name)
        report["eager"][tokens] = (rel_errs(out, reference(xs, residual, weight)), torch.equal(x, kept),
                                   [torch.equal(a, b) for a, b in zip(out + out, donated + tensor_eps)])
    plans = {type(plan).__name__ for plan in cuda_dispatch._PLANS.values()}
    report["plans"] = plans
    report["cpp_calls"] = sum(calls_by_reason().values())

    x, _, residual, weight = inputs(0, 1, 64, 1, device, hidden)
    allreduce_residual_rmsnorm_donate_x(x.clone(), residual, weight, EPS, name)  # warm outside capture
    scratch = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scratch.copy_(x)  # the donated buffer is refilled inside the graph, as a producer would
        out = allreduce_residual_rmsnorm_donate_x(scratch, residual, weight, EPS, name)
    errors = []
    for seed in (2, 3):
        fresh_x, fresh_xs, fresh_residual, _ = inputs(0, 1, 64, seed, device, hidden)
        x.copy_(fresh_x)
        residual.copy_(fresh_residual)
        graph.replay()
        torch.cuda.synchronize()
        errors.append(rel_errs(out, reference(fresh_xs, fresh_residual, weight)))
    report["graph"] = errors
    del graph
    fxfuse.destroy_workspaces(ctx.group, graphs_released=True)
    return report


def test_one_rank_nccl_fallback_eager_donated_and_replayed():
    (report,) = run_on_ranks(one_rank_checks, 1, device="cuda", timeout_s=120)
    assert report["ready"] is False  # nothing fused runs on one rank
    assert report["plans"] == {"NcclPlan"}
    assert report["native"] and report["cpp_calls"] == 8  # the donated and tensor-eps calls of each shape
    for tokens, ((err_normed, err_residual), x_kept, donated_equal) in report["eager"].items():
        assert err_normed < TOLERANCE and err_residual < TOLERANCE, (tokens, err_normed, err_residual)
        assert x_kept and all(donated_equal), tokens
    for err_normed, err_residual in report["graph"]:
        assert err_normed < TOLERANCE and err_residual < TOLERANCE, report["graph"]


def _block_on(group_name: str):
    """Producer `2 * inp`, all-reduce on one group, residual add, transformers-style RMSNorm."""
    import torch.distributed._functional_collectives as funcol

    def block(inp, residual, weight):
        hidden = funcol.all_reduce(inp * 2, "sum", group_name) + residual
        h = hidden.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(hidden.dtype), hidden

    return block


def compiled_block_checks(ctx) -> dict:
    """A producer -> all-reduce -> add -> RMSNorm block compiled by Inductor with the site fused."""
    from torch._inductor.utils import run_and_get_code

    import fxfuse
    from fxfuse.backend import FxfuseBackend

    block = _block_on(ctx.group.group_name)
    device = torch.device("cuda", torch.cuda.current_device())
    fxfuse.prepare(ctx.group, 4096, torch.bfloat16, max_tokens=64)
    backend = FxfuseBackend(fuse_without_fast_kernel=True)
    fused = torch.compile(block, backend=backend, fullgraph=True)
    unfused = torch.compile(block, backend="inductor", fullgraph=True)
    inp, _, residual, weight = inputs(0, 1, 64, 4, device, 4096)
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(fused, inp, residual, weight)
        expected = unfused(inp, residual, weight)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused(inp, residual, weight)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = fused(inp, residual, weight)
        fresh, _, fresh_residual, _ = inputs(0, 1, 64, 5, device, 4096)
        inp.copy_(fresh)
        residual.copy_(fresh_residual)
        graph.replay()
        replay_expected = unfused(inp, residual, weight)
    return {"fused_sites": backend.records[-1].stats.fused, "donates": "donate_x" in code, "clones": "clone" in code,
            "vs_inductor": rel_errs(out, [e.float() for e in expected]),
            "replay_vs_inductor": rel_errs(captured, [e.float() for e in replay_expected])}


def test_compiled_block_fallback_matches_inductor_under_cuda_graphs():
    (report,) = run_on_ranks(compiled_block_checks, 1, device="cuda", timeout_s=240)
    assert report["fused_sites"] == 1 and report["donates"] and not report["clones"]
    for errors in (report["vs_inductor"], report["replay_vs_inductor"]):
        assert max(errors) < 1e-2, report


def compile_without_prepare(ctx) -> dict:
    """A fused block compiled and run with no `fxfuse.prepare`: the backend installs the C++ fallback."""
    from fxfuse.backend import FxfuseBackend
    from fxfuse.op.kernels.native_fallback import calls_by_reason, native_installed

    block = _block_on(ctx.group.group_name)
    device = torch.device("cuda", torch.cuda.current_device())
    installed_before = native_installed()
    fused = torch.compile(block, backend=FxfuseBackend(fuse_without_fast_kernel=True), fullgraph=True)
    inp, xs, residual, weight = inputs(0, 1, 8, 6, device, 4096)
    with torch.no_grad():
        outs = [fused(inp, residual, weight) for _ in range(3)]  # Python decides the shape once, then C++
    expected = reference([2 * x for x in xs], residual, weight)
    return {"installed_before": installed_before, "installed": native_installed(), "cpp_calls": sum(calls_by_reason().values()),
            "errors": [rel_errs(out, expected) for out in outs]}


def test_the_backend_installs_the_cpp_fallback_when_it_compiles_fused_cuda_sites():
    (report,) = run_on_ranks(compile_without_prepare, 1, device="cuda", timeout_s=240)
    assert not report["installed_before"] and report["installed"] and report["cpp_calls"] == 2, report
    for err_normed, err_residual in report["errors"]:
        assert err_normed < TOLERANCE and err_residual < TOLERANCE, report["errors"]


def test_the_fallback_sweep_checks_times_and_records_every_point(tmp_path):
    """`fxfuse bench fallback` at 2 token counts, hidden 4096, every quantization kind, static and dynamic
    shapes: every point passes its float32 check, has both timings, and its fxfuse graph fused the site (tier a)
    or, after a clamp or a second norm, gave it the all-reduce-only op (tier b)."""
    import json

    from fxfuse.bench.arguments import FALLBACK_QUANT
    from fxfuse.bench.fallback import main

    argv = ["--tokens", "1,64", "--hidden", "4096", "--repeats", "3", "--iters", "2", "--host-calls", "5",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("fallback_*.json")
    report = json.loads(path.read_text())
    points = [(r["quant"], r["dynamic"], r["tokens"]) for r in report["rows"]]
    assert points == [(q, d, t) for q in FALLBACK_QUANT for d in (False, True) for t in (1, 64)]
    for row in report["rows"]:
        tier = "b" if row["quant"] in ("clamp_scale", "second_rmsnorm") else "a"
        assert row["ok"] and row["fused_us"] > 0 and row["inductor_us"] > 0 and row["fusion"]["tier"] == tier, row
        assert row["input_sets"] == 2  # tiny inputs: one copy per captured call
    graphs = {(f["quant"], f["dynamic"]): len(f["graphs"]) for f in report["fusion"]}
    assert set(graphs.values()) == {2}  # static: one per token count; dynamic: 1 token, then the rest
    assert [(h["quant"], h["dynamic"]) for h in report["host_cost"]] == [(q, d) for q in FALLBACK_QUANT for d in (False, True)]
    assert report["skipped"] == [] and path.with_suffix(".md").exists()
