"""Quantized models under the fxfuse backend: tp=2 gloo ranks, `torch.compile(fullgraph=True, dynamic=True)`.

The quantized GEMMs trace as single `fxfuse_quant` op nodes (their fake kernels give the shapes), and the
fusion pass still fuses every all-reduce site: 1 (embedding) + 2 per layer = 5 for the two-layer model,
none left unfused, checked on the backend's stats and the rewritten graph's op counts. Logits over a
prefill and verify steps of widths 4 and 2 (one dynamic graph; width 1 compiles apart, see
tests/test_model_fusion.py) match the eager quantized model within 1e-5 (float32). Cases: FP8 (w8a16),
FP8 with per-token-group FP8 activations (w8a8: the dense linears' activation quantization is plain ops in
the graph, tests/test_quant_graph.py, and each linear one `fxfuse_quant::fp8_linear_quantized`; the
quantization after every fused site but the last is folded into the fused op) and INT4
experts, with the eager inner compiler (an Inductor compile of this model takes about two
minutes on 2 CPU cores; Inductor with the quantized ops runs on the GPU in `fxfuse bench model
--weights fp8|int4`, scripts/gpu_check_quant.sh, which checks its logits against eager).
"""

from __future__ import annotations

import pytest
import torch

from quant_helpers import FP8, FP8_W8A8, INT4, TINY_ALIGNED, float_state
from fxfuse.runner.launch import run_on_ranks

SITES = 1 + 2 * TINY_ALIGNED.num_hidden_layers
TOLERANCE = 1e-5
WIDTHS = (6, 4, 2)
ALL_REDUCE, FUSED, FUSED_FP8 = "_c10d_functional.all_reduce", "fxfuse.allreduce_residual_rmsnorm", "fxfuse.allreduce_residual_rmsnorm_fp8"
#: Fused sites whose FP8 quantization is folded into the op: under w8a8 every site but the last (each norm's
#: output feeds FP8 linears: q_a_proj + kv_a_proj, or gate + up; the final norm feeds the bf16 lm_head).
FOLDED = {"fp8": 0, "fp8-w8a8": SITES - 1, "int4": 0}
#: Quantized op nodes per graph: FP8 keeps every projection but kv_b_proj (4 attention + 3 dense-MLP in
#: layer 0; 4 attention + 3 shared-expert + 1 routed-experts op in layer 1); INT4 the routed experts only.
QUANT_OPS = {"fp8": ("fxfuse_quant.fp8_linear", 14, "fxfuse_quant.quant_experts", 1),
             "fp8-w8a8": ("fxfuse_quant.fp8_linear_quantized", 14, "fxfuse_quant.quant_experts", 1),
             "int4": ("fxfuse_quant.fp8_linear", 0, "fxfuse_quant.quant_experts", 1)}


def _build(ctx, scheme):
    from fxfuse.models.deepseek_v3 import DeepseekV3ForCausalLM
    from fxfuse.models.quant.checkpoint import quantize_state_dict
    from fxfuse.models.weights import DictSource, load_weights

    model = DeepseekV3ForCausalLM(TINY_ALIGNED, ctx, dtype=torch.float32, max_batch=2, max_seq_len=32, quant=scheme)
    load_weights(model, DictSource(quantize_state_dict(float_state(), scheme), config=scheme.checkpoint_config()), ctx)
    return model.eval()


def _schedule():
    generator, position, steps = torch.Generator().manual_seed(0), 0, []
    for width in WIDTHS:
        ids = torch.randint(TINY_ALIGNED.vocab_size, (2, width), generator=generator)
        steps.append((ids, torch.arange(position, position + width).expand(2, -1).contiguous()))
        position += width
    return steps


@torch.inference_mode()
def _compile_checks(ctx, cases) -> dict:
    """Rank body: per (name, scheme, inner): fusion stats, op counts after the pass, errors vs eager."""
    from fxfuse.backend import FxfuseBackend

    results = {}
    for name, scheme, inner in cases:
        torch._dynamo.reset()
        eager, model = _build(ctx, scheme), _build(ctx, scheme)
        backend = FxfuseBackend(inner=inner)
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
        errors = []
        for ids, positions in _schedule():
            expected, got = eager(ids, positions), compiled(ids, positions)
            errors.append(float((got - expected).abs().max() / expected.abs().max()))
        results[name] = {"errors": errors, "stats": [r.stats for r in backend.records],
                         "after": [dict(r.after.op_counts) for r in backend.records]}
    return results


CASES = [("fp8", FP8, "eager"), ("fp8-w8a8", FP8_W8A8, "eager"), ("int4", INT4, "eager")]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_compile_checks, 2, CASES, timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_every_site_fused_and_quantized_ops_traced(results, case):
    linear_op, linears, experts_op, expert_ops = QUANT_OPS[case]
    for rank in results:
        records = rank[case]
        assert len(records["stats"]) == 1  # one graph for every width
        for stats, after in zip(records["stats"], records["after"], strict=True):
            assert (stats.allreduces_before, stats.fused, stats.allreduces_after) == (SITES, SITES, 0), stats
            assert stats.fp8_quantizations_folded == FOLDED[case], stats
            assert after.get(ALL_REDUCE, 0) == 0 and after.get(FUSED, 0) + after.get(FUSED_FP8, 0) == SITES
            assert after.get(FUSED_FP8, 0) == FOLDED[case], after
            assert after.get(linear_op, 0) == linears and after.get(experts_op, 0) == expert_ops, after


@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_compiled_quantized_logits_match_eager(results, case):
    for rank in results:
        for width, error in zip(WIDTHS, rank[case]["errors"], strict=True):
            assert error <= TOLERANCE, f"{case}, width {width}: relative error {error:.3g}"
