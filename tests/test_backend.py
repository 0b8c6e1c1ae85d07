"""The backend end to end: entry point, configuration, records/dumps/counters, dynamic token counts,
and fused-vs-unfused numerics on two gloo ranks (eager and Inductor inner compilers)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from toy_graphs import (
    RMSNORMS,
    compile_and_run,
    decoder_inputs,
    deepseek_moe_block,
    fake_process_group,
    funcol_all_reduce,
    toy_decoder,
)

from fxfuse.backend import FxfuseBackend
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PATTERNS

FUSED = "fxfuse.allreduce_residual_rmsnorm"


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def decoder_for(group, norm="transformers"):
    return functools.partial(toy_decoder, group=group, norm=RMSNORMS[norm])


# ---------------------------------------------------------------- entry point and configuration


@pytest.mark.slow
def test_entry_point_without_importing_fxfuse():
    """`backend="fxfuse"` resolves through the installed entry point; the default inner is Inductor."""
    script = textwrap.dedent(
        """
        import json, sys
        import torch, torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch._dynamo.utils import counters
        from torch.testing._internal.distributed.fake_pg import FakeStore

        assert not any(name.startswith("fxfuse") for name in sys.modules)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

        def block(x, residual, weight):
            h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            h32 = h.float()
            return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h

        args = (torch.randn(4, 16), torch.randn(4, 16), torch.randn(16))
        with torch.no_grad():
            out = torch.compile(block, backend="fxfuse", fullgraph=True)(*args)
        torch.testing.assert_close(out, block(*args))
        assert "fxfuse.backend" in sys.modules
        print(json.dumps(dict(counters["fxfuse"])))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "allreduces_before": 1,
        "merged": 0,
        "fused_with_residual": 1,
        "fused_without_residual": 0,
        "allreduces_after": 0,
        "fp8_quantizations_folded": 0,
        "fast_all_reduces": 0,
    }


def test_unknown_inner_compiler_rejected():
    with pytest.raises(ValueError, match="inner compiler"):
        FxfuseBackend(inner="tvm")


def test_unknown_pattern_rejected():
    with pytest.raises(ValueError, match="unknown fxfuse pattern"):
        FxfuseBackend(inner="eager", patterns=["allreduce_layernorm"])


def test_one_pattern_string_rejected_with_the_fix():
    """Issue 41: a string used to be taken as a set of its letters (13 unknown single-letter patterns)."""
    with pytest.raises(ValueError, match=r"got the string 'allreduce_residual_rmsnorm': write "
                                         r"patterns=\['allreduce_residual_rmsnorm'\]"):
        FxfuseBackend(inner="eager", patterns="allreduce_residual_rmsnorm")


def test_an_unwritable_dump_dir_is_refused_where_it_is_given(tmp_path, monkeypatch):
    """Issue 41: a read-only dump_dir used to fail only at the first compile, as BackendCompilerFailed. (Root writes
    read-only directories, so the refusal is checked with access denied to this process.)"""
    from fxfuse.rewrite import recorder

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    monkeypatch.setattr(recorder.os, "access", lambda path, mode: Path(path) != read_only)
    with pytest.raises(ValueError, match="is not writable by this process"):
        FxfuseBackend(inner="eager", dump_dir=read_only / "graphs")
    monkeypatch.undo()
    FxfuseBackend(inner="eager", dump_dir=read_only / "graphs")  # writable: accepted, nothing made yet
    assert not (read_only / "graphs").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        FxfuseBackend(inner="eager", dump_dir=tmp_path / "file" / "graphs")


def test_mode_and_options_go_to_inductor_and_are_checked():
    """Issue 41: `torch.compile(..., backend="fxfuse", mode=...)` passes mode/options to the backend, as transformers'
    CompileConfig does (mode="reduce-overhead" by default): they configure the inner Inductor, are checked by
    Inductor's own rules, and are refused for the eager inner compiler."""
    from fxfuse.backend import inductor_config_patches

    assert inductor_config_patches("inductor", "reduce-overhead", None) == {"triton.cudagraphs": True}
    assert inductor_config_patches("inductor", None, {"max_autotune": True}) == {"max_autotune": True}
    assert inductor_config_patches("eager", "default", None) == {}
    with pytest.raises(ValueError, match="the eager inner compiler|which takes neither"):
        FxfuseBackend(inner="eager", mode="max-autotune")
    with pytest.raises(ValueError, match="Unrecognized mode=fast"):
        FxfuseBackend(mode="fast")
    with pytest.raises(ValueError, match="Unexpected optimization option no_such_option"):
        FxfuseBackend(options={"no_such_option": 1})


@pytest.mark.slow
def test_backend_fxfuse_with_a_mode_compiles_and_fuses(group):
    """`torch.compile(block, backend="fxfuse", mode="reduce-overhead")` (the entry point; Inductor inner) fuses."""
    counters.clear()
    torch._dynamo.reset()
    inputs = decoder_inputs(torch.float32)
    with torch.no_grad():
        out = torch.compile(decoder_for(group), backend="fxfuse", mode="reduce-overhead", fullgraph=True)(*inputs)
    torch._dynamo.reset()
    assert counters["fxfuse"]["fused_with_residual"] + counters["fxfuse"]["fused_without_residual"] == 4
    torch.testing.assert_close(out, decoder_for(group)(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("patterns", "without_residual", "with_residual"),
    [
        (PATTERNS, 1, 3),
        ((ALLREDUCE_RMSNORM,), 1, 0),
        ((ALLREDUCE_RESIDUAL_RMSNORM,), 0, 3),
        ((), 0, 0),
    ],
    ids=["all", "only_plain", "only_residual", "none"],
)
def test_each_pattern_can_be_switched(group, patterns, without_residual, with_residual):
    backend = FxfuseBackend(inner="eager", patterns=patterns)
    inputs = decoder_inputs(torch.float32)
    _, out = compile_and_run(decoder_for(group), *inputs, backend=backend)
    (record,) = backend.records
    assert (record.stats.fused_without_residual, record.stats.fused_with_residual) == (without_residual, with_residual)
    assert record.stats.allreduces_after == 4 - without_residual - with_residual
    assert record.after.op_counts[FUSED] == without_residual + with_residual
    torch.testing.assert_close(out, decoder_for(group)(*inputs), rtol=1e-5, atol=1e-6)


def test_records_counters_and_diff(group):
    counters.clear()
    backend, _ = compile_and_run(decoder_for(group), *decoder_inputs(torch.bfloat16))
    (record,) = backend.records
    assert record.stats.fused == 4 and record.stats.allreduces_before == 4
    assert counters["fxfuse"]["fused_with_residual"] == 3
    assert counters["fxfuse"]["fused_without_residual"] == 1
    diff = record.diff()
    assert diff.splitlines()[0].split() == ["op", "before", "after"]
    assert any(line.startswith("-") and "_c10d_functional.all_reduce(" in line for line in diff.splitlines())
    assert any(line.startswith("+") and f"{FUSED}(" in line for line in diff.splitlines())


def test_dump_dir_gets_before_after_and_diff(group, tmp_path):
    backend = FxfuseBackend(inner="eager", dump_dir=tmp_path / "graphs")
    compile_and_run(decoder_for(group), *decoder_inputs(torch.float32), backend=backend)
    stem = tmp_path / "graphs" / "graph_000_rank0"
    before, after, diff = (stem.with_name(f"{stem.name}.{part}.txt").read_text() for part in ("before", "after", "diff"))
    assert before.count("_c10d_functional.all_reduce(") == 4 and FUSED not in before
    assert after.count(f"{FUSED}(") == 4 and "_c10d_functional.all_reduce(" not in after
    assert diff.startswith("FusionStats(") and "fused_with_residual=3" in diff


def test_graph_without_collectives_passes_through(group):
    def local_block(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    backend, out = compile_and_run(local_block, x, w)
    (record,) = backend.records
    assert record.after.lines == record.before.lines
    assert record.diff() == "graphs are identical\n"
    assert record.stats.allreduces_before == record.stats.fused == 0
    torch.testing.assert_close(out, local_block(x, w))


@pytest.mark.slow
def test_token_counts_1_to_128_compile_once(group):
    """mark_dynamic on the token dimension: one compile serves every width from 1 to 128.

    Width 1 would otherwise be specialized by dynamo (a second compile); backed_size_oblivious
    turns that 0/1 specialization off.
    """
    decoder = decoder_for(group)
    backend = FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(decoder, backend=backend, fullgraph=True)
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for tokens in range(1, 129):
            inputs = decoder_inputs(torch.float32, tokens=tokens)
            torch._dynamo.mark_dynamic(inputs[0], 0)
            torch.testing.assert_close(compiled(*inputs), decoder(*inputs), rtol=1e-5, atol=1e-6)
    assert len(backend.records) == 1 and backend.records[0].stats.fused == 4
    assert counters["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------- numerics on two gloo ranks


def _rank_inputs(dtype, rank, *shapes):
    """One tensor per shape: the first differs per rank (a partial sum), the rest are common."""
    own, common = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=own if i == 0 else common).to(dtype) for i, shape in enumerate(shapes)]


def _moe_inputs(dtype, rank):
    x, residual, weight = _rank_inputs(dtype, rank, (5, 32), (5, 32), (32,))
    experts = torch.Generator().manual_seed(rank + 7)  # this rank's shard of routed and shared experts
    w_routed, w_shared = ((torch.randn(32, 32, generator=experts) / 32**0.5).to(dtype) for _ in range(2))
    return x, residual, w_routed, w_shared, weight


def _single_site(x, residual, weight, *, group, norm):
    h = funcol_all_reduce(x, group) + residual
    return RMSNORMS[norm](h, weight, 1e-6), h


def _rank_cases(rank, group):
    """(name, function, inputs, inner compiler) of every numerics case; inputs differ per rank."""
    cases = []
    for norm in RMSNORMS:
        cases.append((f"decoder/{norm}/float32", decoder_for(group, norm), decoder_inputs(torch.float32, seed=rank), "eager"))
    for norm in ("transformers", "weight_on_right"):
        for dtype in (torch.bfloat16, torch.float16):
            cases.append((f"decoder/{norm}/{dtype}", decoder_for(group, norm), decoder_inputs(dtype, seed=rank), "eager"))
    for norm in ("functional", "weight_in_fp32", "weight_in_fp32_left"):
        site = functools.partial(_single_site, group=group, norm=norm)
        cases.append((f"site/{norm}/bfloat16", site, _rank_inputs(torch.bfloat16, rank, (64, 32), (64, 32), (32,)), "eager"))
    for dtype in (torch.float32, torch.bfloat16):
        cases.append((f"moe_merge/{dtype}", functools.partial(deepseek_moe_block, group=group), _moe_inputs(dtype, rank), "eager"))
    cases.append(("decoder/transformers/bfloat16/inductor", decoder_for(group), decoder_inputs(torch.bfloat16, seed=rank), "inductor"))
    return cases


def _fused_vs_unfused_on_rank(ctx):
    """Compile every case on this rank; return (name, fused output, unfused output, stats, graph)."""
    results = []
    for name, fn, inputs, inner in _rank_cases(ctx.rank, ctx.group):
        backend, fused = compile_and_run(fn, *inputs, backend=FxfuseBackend(inner=inner))
        with torch.no_grad():
            unfused = fn(*inputs)
        (record,) = backend.records
        results.append((name, fused, unfused, record.stats, record.after.lines))
    return results


@pytest.fixture(scope="module")
def two_rank_results():
    from fxfuse.runner.launch import run_on_ranks

    return run_on_ranks(_fused_vs_unfused_on_rank, 2)


def _case(results, name):
    (match,) = [r for r in results if r[0] == name]
    return match


@pytest.mark.slow
def test_ranks_rewrite_identically(two_rank_results):
    rank0, rank1 = two_rank_results
    assert [(r[0], r[3], r[4]) for r in rank0] == [(r[0], r[3], r[4]) for r in rank1]


@pytest.mark.slow
@pytest.mark.parametrize("norm", list(RMSNORMS))
def test_fp32_decoder_within_1e5(two_rank_results, norm):
    for results in two_rank_results:
        _, fused, unfused, stats, _ = _case(results, f"decoder/{norm}/float32")
        assert stats.fused == 4
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["transformers", "weight_on_right"])
def test_low_precision_decoder_bit_identical(two_rank_results, norm, dtype):
    """Same order of operations as the unfused model: identical bits, all-reduce included."""
    for results in two_rank_results:
        _, fused, unfused, stats, _ = _case(results, f"decoder/{norm}/{dtype}")
        assert stats.fused == 4
        torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["functional", "weight_in_fp32", "weight_in_fp32_left"])
def test_bf16_weight_in_fp32_within_one_rounding(two_rank_results, norm):
    for results in two_rank_results:
        _, (normed, residual_out), (expected_normed, expected_residual), stats, _ = _case(results, f"site/{norm}/bfloat16")
        assert stats.fused_with_residual == 1
        torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
        torch.testing.assert_close(normed, expected_normed, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merged_moe_block(two_rank_results, dtype):
    """One all-reduce of (routed + shared) instead of two: equal in fp32, bf16 rounding in bf16."""
    for results in two_rank_results:
        _, fused, unfused, stats, _ = _case(results, f"moe_merge/{dtype}")
        assert (stats.merged, stats.fused_with_residual, stats.allreduces_after) == (1, 1, 0)
        if dtype == torch.float32:
            torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(fused, unfused, rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps)


@pytest.mark.slow
def test_inductor_decoder_bf16(two_rank_results):
    for results in two_rank_results:
        _, fused, unfused, stats, _ = _case(results, "decoder/transformers/bfloat16/inductor")
        assert stats.fused == 4 and stats.allreduces_after == 0
        torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
