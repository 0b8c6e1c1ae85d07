"""torch.compile(fullgraph=True) of the reference model's decode step at tp=2 on CPU (gloo ranks).

Stock inductor compiles the tiny model's step, cut to 2 layers (one dense-MLP, one MoE layer: every
kind of all-reduce, half the compile time), and must match eager logits step for step. Steps use
`dynamic=False`: one static graph per step width (1-token decode, 4-token verify), as CUDA graph
capture wants, and no dynamic-shape recompile. The traced graph must hold exactly the model's
collectives: 1 + 2 * layers all-reduces and one logits all-gather. A cold inductor cache makes the
first run of this file take a minute or two on a small CPU; later runs reuse the cache.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fxfuse.runner.launch import run_on_ranks
from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import get_preset
from fxfuse.models.random_weights import random_hf_state_dict
from fxfuse.models.weights import DictSource, load_weights

LAYERS, BATCH, PROMPT_LEN, MAX_SEQ_LEN = 2, 2, 12, 32
STEP_WIDTHS = (1, 4, 1, 4)
TOLERANCE = 1e-5


def build_model(ctx: ParallelContext, dtype=torch.float32, expert_impl="auto") -> DeepseekV3ForCausalLM:
    """The 2-layer tiny model with deterministic random weights (the same model at any tp)."""
    config = get_preset("tiny", layers=LAYERS)
    model = DeepseekV3ForCausalLM(
        config, ctx, dtype=dtype, device="cpu", max_batch=BATCH, max_seq_len=MAX_SEQ_LEN, expert_impl=expert_impl
    )
    load_weights(model, DictSource(random_hf_state_dict(config, seed=0)), ctx)
    return model


def decode_schedule(vocab_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(prefill step, decode/verify steps) as (input_ids, positions) [B, T]."""
    generator = torch.Generator().manual_seed(0)
    prefill = (torch.randint(vocab_size, (BATCH, PROMPT_LEN), generator=generator), torch.arange(PROMPT_LEN).expand(BATCH, -1))
    steps, position = [], PROMPT_LEN
    for width in STEP_WIDTHS:
        positions = torch.arange(position, position + width).expand(BATCH, -1).contiguous()
        steps.append((torch.randint(vocab_size, (BATCH, width), generator=generator), positions))
        position += width
    return prefill, steps


def collectives_in_graph(graph: torch.fx.Graph) -> Counter:
    """How many times each functional collective is called in a traced graph."""
    return Counter(
        str(node.target).removeprefix("_c10d_functional.")
        for node in graph.nodes
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.")
    )


@torch.inference_mode()
def compile_and_compare(ctx: ParallelContext) -> dict:
    """On one rank: eager vs inductor-compiled decode steps, graphs compiled, collectives traced."""
    torch._inductor.config.compile_threads = 1  # no compile worker pool per rank on a small CPU
    torch._dynamo.reset()
    model = build_model(ctx)
    prefill, steps = decode_schedule(model.config.vocab_size)

    model(*prefill)
    eager = [model(*step) for step in steps]

    model.reset_cache()
    model(*prefill)
    compiled_step = torch.compile(model, fullgraph=True, dynamic=False)
    compiled = [compiled_step(*step) for step in steps]
    graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    traced = []
    torch.compile(model, fullgraph=True, backend=lambda gm, _: traced.append(gm.graph) or gm.forward)(*steps[0])
    return {"eager": eager, "compiled": compiled, "graphs": graphs_compiled, "collectives": collectives_in_graph(traced[0])}


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(compile_and_compare, 2)


@pytest.mark.slow
def test_compiled_decode_step_matches_eager_at_tp2(tp2_results):
    for rank in tp2_results:
        for width, actual, expected in zip(STEP_WIDTHS, rank["compiled"], rank["eager"]):
            error = float((actual - expected).abs().max() / expected.abs().max())
            assert error <= TOLERANCE, f"width-{width} step: relative error {error:.3g}"


@pytest.mark.slow
def test_one_static_graph_per_step_width(tp2_results):
    assert {rank["graphs"] for rank in tp2_results} == {len(set(STEP_WIDTHS))}


@pytest.mark.slow
def test_traced_step_has_exactly_the_models_collectives(tp2_results):
    for rank in tp2_results:
        assert rank["collectives"]["all_reduce"] == 1 + 2 * LAYERS  # embedding, then attention + MLP/MoE per layer
        assert rank["collectives"]["all_gather_into_tensor"] == 1  # gathered logits
        assert rank["collectives"]["wait_tensor"] == 2 + 2 * LAYERS


def test_grouped_mm_expert_path_traces_without_graph_breaks():
    """The CUDA bf16 expert path (sorted tokens, torch._grouped_mm) traces fullgraph: no host syncs,
    no data-dependent shapes. (The dense path is traced and compiled by the tp=2 tests above.)"""
    torch._dynamo.reset()
    model = build_model(ParallelContext(), dtype=torch.bfloat16, expert_impl="grouped_mm")
    _, steps = decode_schedule(model.config.vocab_size)
    traced = []
    with torch.inference_mode():
        torch.compile(model, fullgraph=True, backend=lambda gm, _: traced.append(gm.graph) or gm.forward)(*steps[1])
    assert any("_grouped_mm" in str(node.target) for node in traced[0].nodes if node.op == "call_function")
