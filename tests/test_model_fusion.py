"""The fxfuse backend on the reference DeepSeek-V3 model: the tiny preset at tp=2 on two gloo ranks.

Every all-reduce site is fused: 2 per layer + 1 after the vocab-parallel embedding = 9 for the
4-layer tiny preset, counted by the backend's stats and by the ops of the rewritten graph (no
`_c10d_functional.all_reduce` left). Compiles use `fullgraph=True, dynamic=True` as users do.
Step widths: plain dynamic=True compiles a width of 1 apart (the model's einsums guard on size 1;
`backed_size_oblivious` does not lift that guard). With the eager inner compiler the width is
marked unbacked (`mark_token_dim_unbacked`) and one graph serves the prefill and every width from 1
to 128. Inductor (torch 2.13) cannot lower a bmm over an unbacked width (its layout check guards on
size 1), so the Inductor case runs plain dynamic=True: one graph for widths >= 2, one for width 1.

Numerics against the eager model, over a 12-token prefill and decode/verify steps of widths 1 and 4:
- float32: relative error (max |diff| / max |logit|) <= 1e-5, with the eager inner compiler and once
  with Inductor (cut to 2 layers: one dense, one MoE layer, every kind of site, half the compile);
- bfloat16: the fused graph equals the same graph compiled unfused bit for bit (the fused op keeps
  the model's rounding order); against eager the bound is bf16 rounding of differently ordered
  decomposed ops: relative error <= 2**-5 (a few bf16 ulps, 2**-8 each, accumulated over 4 layers
  and the lm_head; unrelated logits would be off by O(1)). Measured on torch 2.13: 0 (bf16) and
  at most 5e-7 (fp32).

The DeepSeek-official variant (shared experts all-reducing on their own, merged then fused) is
covered at block level by tests/test_merge_allreduce.py; the reference model has one all-reduce
per MoE block, so there is nothing to merge here. All checks of a rank run in one spawn, the eager
inner compiler's then Inductor's: it compiles the model several times (tens of seconds each on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fxfuse.backend import FxfuseBackend, fusion_summary
from fxfuse.runner.launch import run_on_ranks
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import get_preset
from fxfuse.models.random_weights import random_hf_state_dict
from fxfuse.models.weights import DictSource, load_weights

BATCH, PROMPT_LEN, MAX_SEQ_LEN = 2, 12, 160
STEP_WIDTHS = (1, 4, 1, 4)
SWEEP_WIDTHS = range(1, 129)
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2**-5
ALL_REDUCE, FUSED = "_c10d_functional.all_reduce", "fxfuse.allreduce_residual_rmsnorm"


def expected_sites(layers: int) -> int:
    """All-reduce sites of the reference model: the embedding, then attention + MLP/MoE per layer."""
    return 1 + 2 * layers


def build_model(ctx: ParallelContext, dtype: torch.dtype, layers: int | None = None) -> DeepseekV3ForCausalLM:
    """The tiny preset with deterministic random weights (the same model at any tp)."""
    config = get_preset("tiny", layers=layers)
    model = DeepseekV3ForCausalLM(config, ctx, dtype=dtype, device="cpu", max_batch=BATCH, max_seq_len=MAX_SEQ_LEN)
    load_weights(model, DictSource(random_hf_state_dict(config, seed=0, dtype=dtype)), ctx)
    return model.eval()


def mark_token_dim_unbacked(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Make the step width one unbacked size shared by both inputs: never specialized, even at 1."""
    for tensor in (input_ids, positions):
        torch._dynamo.decorators.mark_unbacked(tensor, 1, shape_id="tokens")


def decode_schedule(vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A 12-token prefill then decode/verify steps of `STEP_WIDTHS`, as (input_ids, positions) [B, T]."""
    generator = torch.Generator().manual_seed(0)
    steps, position = [], 0
    for width in (PROMPT_LEN, *STEP_WIDTHS):
        ids = torch.randint(vocab_size, (BATCH, width), generator=generator)
        steps.append((ids, torch.arange(position, position + width).expand(BATCH, -1).contiguous()))
        position += width
    return steps


def sweep_schedule(vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step of every width in `SWEEP_WIDTHS`, each written at positions 0..width-1."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randint(vocab_size, (BATCH, width), generator=generator), torch.arange(width).expand(BATCH, -1).contiguous())
        for width in SWEEP_WIDTHS
    ]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max())


def compile_step(model: torch.nn.Module, backend: FxfuseBackend, unbacked_width: bool = True):
    """`torch.compile` as users call it (fullgraph, dynamic shapes), optionally with the step width
    marked unbacked on every call."""
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    if not unbacked_width:
        return compiled

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        input_ids, positions = input_ids.clone(), positions.clone()  # marks stay off the caller's tensors
        mark_token_dim_unbacked(input_ids, positions)
        return compiled(input_ids, positions)

    return step


def graph_summary(backend: FxfuseBackend) -> dict:
    """Per compile: the stats and the op counts before/after that the tests check."""
    return {
        "compiles": len(backend.records),
        "stats": [record.stats for record in backend.records],
        "before": [dict(record.before.op_counts) for record in backend.records],
        "after": [dict(record.after.op_counts) for record in backend.records],
    }


def run_steps(steps, schedule) -> list[torch.Tensor]:
    """Logits of each step of `schedule`, run in order by each of `steps` (caches advance together)."""
    return [[step(ids, positions) for step in steps] for ids, positions in schedule]


@torch.inference_mode()
def eager_inner_checks(ctx: ParallelContext) -> dict:
    """One rank: float32 steps and width sweep vs eager; bfloat16 fused vs unfused vs eager."""
    torch._dynamo.reset()
    counters.clear()
    results = {}

    eager, model = build_model(ctx, torch.float32), build_model(ctx, torch.float32)
    backend = FxfuseBackend(inner="eager")
    compiled = compile_step(model, backend)
    schedule = decode_schedule(model.config.vocab_size)
    results["fp32_errors"] = [relative_error(c, e) for e, c in run_steps((eager, compiled), schedule)]
    sweep = sweep_schedule(model.config.vocab_size)
    results["sweep_errors"] = [relative_error(c, e) for e, c in run_steps((eager, compiled), sweep)]
    results["fp32"] = graph_summary(backend)
    results["fusion_summary"] = fusion_summary(backend)
    results["unique_graphs"] = counters["stats"]["unique_graphs"]

    eager, fused_model, unfused_model = (build_model(ctx, torch.bfloat16) for _ in range(3))
    fused_backend, unfused_backend = FxfuseBackend(inner="eager"), FxfuseBackend(inner="eager", patterns=())
    steps = (eager, compile_step(fused_model, fused_backend), compile_step(unfused_model, unfused_backend))
    results["bf16_logits"] = run_steps(steps, decode_schedule(eager.config.vocab_size))
    results["bf16"] = graph_summary(fused_backend)
    results["bf16_unfused"] = graph_summary(unfused_backend)
    return results


@torch.inference_mode()
def inductor_checks(ctx: ParallelContext) -> dict:
    """One rank: the 2-layer float32 model compiled by fxfuse with Inductor (plain dynamic=True) vs eager."""
    torch._inductor.config.compile_threads = 1  # no compile worker pool per rank on a small CPU
    torch._dynamo.reset()
    eager, model = build_model(ctx, torch.float32, layers=2), build_model(ctx, torch.float32, layers=2)
    backend = FxfuseBackend(inner="inductor")
    step = compile_step(model, backend, unbacked_width=False)
    logits = run_steps((eager, step), decode_schedule(model.config.vocab_size))
    return {"errors": [relative_error(c, e) for e, c in logits], **graph_summary(backend)}


def all_checks(ctx: ParallelContext) -> dict:
    """One rank: the eager-inner checks, then the Inductor ones (each resets dynamo first)."""
    return {"eager_inner": eager_inner_checks(ctx), "inductor": inductor_checks(ctx)}


@pytest.fixture(scope="module")
def results():
    """Every rank's results of both check sets, from one spawn of 2 gloo ranks (the ranks start, import
    torch and join the group once instead of twice)."""
    return run_on_ranks(all_checks, 2)


@pytest.fixture(scope="module")
def eager_inner_results(results):
    return [rank["eager_inner"] for rank in results]


@pytest.fixture(scope="module")
def inductor_results(results):
    return [rank["inductor"] for rank in results]


def assert_every_site_fused(summary: dict, layers: int) -> None:
    """In every compiled graph: all sites fused, by the stats and by the op counts before/after."""
    sites = expected_sites(layers)
    for stats, before, after in zip(summary["stats"], summary["before"], summary["after"], strict=True):
        assert (stats.allreduces_before, stats.fused_without_residual, stats.fused_with_residual) == (sites, 1, sites - 1)
        assert (stats.merged, stats.allreduces_after) == (0, 0)
        assert (before[ALL_REDUCE], before.get(FUSED, 0)) == (sites, 0)
        assert (after.get(ALL_REDUCE, 0), after[FUSED]) == (0, sites)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_site_fused_in_one_compile(eager_inner_results, dtype):
    """9 sites (2 per layer + embedding), all fused; prefill and every step width share one graph."""
    for rank in eager_inner_results:
        assert rank[dtype]["compiles"] == 1
        assert_every_site_fused(rank[dtype], layers=4)


@pytest.mark.slow
def test_no_recompile_for_widths_1_to_128(eager_inner_results):
    for rank in eager_inner_results:
        assert len(rank["sweep_errors"]) == len(SWEEP_WIDTHS)
        assert rank["fp32"]["compiles"] == 1
        assert rank["unique_graphs"] == 1


@pytest.mark.slow
def test_fusion_summary_for_the_runner(eager_inner_results):
    for rank in eager_inner_results:
        assert rank["fusion_summary"] == {"allreduce_sites": 9, "fused_sites": 9, "fast_all_reduces": 0, "merged": 0,
                                           "graphs_compiled": 1}
    assert fusion_summary(FxfuseBackend(inner="eager")) == {
        "allreduce_sites": None, "fused_sites": None, "fast_all_reduces": None, "merged": None, "graphs_compiled": 0
    }


@pytest.mark.slow
def test_fp32_logits_match_eager(eager_inner_results):
    for rank in eager_inner_results:
        for width, error in zip((PROMPT_LEN, *STEP_WIDTHS), rank["fp32_errors"]):
            assert error <= FP32_TOLERANCE, f"width-{width} step: relative error {error:.3g}"
        for width, error in zip(SWEEP_WIDTHS, rank["sweep_errors"]):
            assert error <= FP32_TOLERANCE, f"width-{width} sweep step: relative error {error:.3g}"


@pytest.mark.slow
def test_bf16_fused_equals_unfused_and_matches_eager(eager_inner_results):
    for rank in eager_inner_results:
        assert [stats.fused for stats in rank["bf16_unfused"]["stats"]] == [0]
        for width, (eager, fused, unfused) in zip((PROMPT_LEN, *STEP_WIDTHS), rank["bf16_logits"]):
            torch.testing.assert_close(fused, unfused, rtol=0, atol=0, msg=f"width-{width} step")
            error = relative_error(fused, eager)
            assert error <= BF16_TOLERANCE, f"width-{width} step: relative error {error:.3g}"


@pytest.mark.slow
def test_ranks_agree(eager_inner_results):
    """Both ranks rewrite identically (the same stats, and the passes changed the same op counts: torch 2.15 traces
    the rotary embedding of one rank with one `sub` fewer, before any pass) and compute the same (replicated)
    logits."""
    rank0, rank1 = eager_inner_results
    assert rank0["fp32"]["stats"] == rank1["fp32"]["stats"] and _changes(rank0["bf16"]) == _changes(rank1["bf16"])
    for logits0, logits1 in zip(rank0["bf16_logits"], rank1["bf16_logits"]):
        torch.testing.assert_close(logits0[1], logits1[1], rtol=0, atol=0)


def _changes(summary: dict) -> list[dict]:
    """Per compile, how the passes changed each op's count."""
    return [{op: after.get(op, 0) - before.get(op, 0) for op in {*before, *after} if after.get(op, 0) != before.get(op, 0)}
            for before, after in zip(summary["before"], summary["after"], strict=True)]


@pytest.mark.slow
def test_inductor_every_site_fused_and_matches_eager(inductor_results):
    for rank in inductor_results:
        assert rank["compiles"] == 2  # widths >= 2 (prefill, width 4), and width 1
        assert_every_site_fused(rank, layers=2)
        for width, error in zip((PROMPT_LEN, *STEP_WIDTHS), rank["errors"]):
            assert error <= FP32_TOLERANCE, f"width-{width} step: relative error {error:.3g}"
