"""Tensor-parallel code written elsewhere, compiled with the fxfuse backend on 2 gloo CPU ranks.

- transformers' own tensor-parallel plans (`tp_plan="auto"`: each model's `base_model_tp_plan`) for
  dense models (Llama; Gemma 3, whose zero-centred norms sandwich each block) and two MoE models
  (DeepseekV3, Qwen3-MoE), applied by transformers' own
  `prepare_distribute_model` + `maybe_distribute_model` (what `from_pretrained(...,
  distributed_config=DistributedConfig(tp_plan="auto"))` runs; `from_pretrained` itself refuses a TP
  plan without the `accelerate` package, which this environment does not have), on tiny models built
  from config objects (no download);
- torch's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` on a transformers Llama;
- a gpt-fast-style and a DeepSeek-official-style model (`tp_styles`).

Every model runs in float32 and bfloat16 under `torch.no_grad()`, compiled with `fullgraph=True` and the
eager inner compiler; each test checks the exact numbers of all-reduces, merges, fused sites and tier-(b)
sites (on both ranks), that no all-reduce is left but those `LEFT_UNFUSED` names, which sites are in tier (b)
(`TIER_B`, each with its reason), and the compiled logits against the same model run eagerly: float32 within 1e-5 (relative to the largest logit), bfloat16 within the bound measured below. One
spawn of 2 ranks runs every model (transformers is imported once per rank); each test reads its result.
"""

from __future__ import annotations

import re
import traceback
from importlib.metadata import version

import pytest
import torch

from fxfuse.runner.launch import run_on_ranks

#: The oldest transformers whose TP plans this file's expectations were checked on (its plans change between
#: releases: 5.15's Llama plan leaves the embedding replicated, 5.25's MoE plans replicate the routed experts).
OLDEST_CHECKED_TRANSFORMERS = (5, 24)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        tuple(int(part) for part in version("transformers").split(".")[:2]) < OLDEST_CHECKED_TRANSFORMERS,
        reason=f"transformers {version('transformers')} is older than {'.'.join(map(str, OLDEST_CHECKED_TRANSFORMERS))}, "
        "the oldest whose tensor-parallel plans "
        "these expectations were checked on (`pip install -e .[test]` installs a newer one)",
    ),
]

DTYPES = (torch.float32, torch.bfloat16)
#: float32, compiled vs eager: max |diff| / max |eager logit|. Measured 1.7e-7 to 2.9e-7 (summation order).
FP32_BOUND = 1e-5
#: bfloat16, same measure, where a model's routed and shared expert outputs are merged into one all-reduce:
#: merging rounds their local sum to bfloat16 before reducing (DeepseekV3 up to transformers 5.24: 2.9e-3,
#: DeepSeek-official style: 3.9e-3). Bounds: about twice the measured values. Where nothing is merged the
#: bound is 0 (measured bit for bit): the fused op applies the weight after the cast back or in float32
#: before it, as each model's norm does (Gemma's `1 + w` and F.rms_norm included).
MERGED_BF16_BOUND = {"hf_deepseek_v3_tp_plan": 6e-3, "deepseek_official_style": 8e-3}

#: (all-reduces before the passes, merged pairs, fused with residual, fused without residual, all-reduce-only
#: ops: tier (b), `fxfuse.passes.site_tiers`).
EXPECTED_SITES = {
    # embedding (rowwise vocab) + 2 x (attention o_proj, MLP down_proj): every site fused
    "hf_llama_tp_plan": (5, 0, 4, 1, 0),
    # the MoE models: `_moe_plan_sites`, which depends on the installed transformers' plans
    "hf_deepseek_v3_tp_plan": None,
    "hf_qwen3_moe_tp_plan": None,
    # Gemma 3: embedding (left: `LEFT_UNFUSED`) + 2 x (attention o_proj, MLP down_proj), each all-reduce
    # straight into its sandwich norm (post-attention / post-feedforward, Gemma's `1 + w` in float32), whose
    # output the residual add reads: Inductor fuses that norm, the add and the next norm into one kernel, so
    # these four sites take the all-reduce-only op (tier b) and leave the norms to Inductor
    "hf_gemma3_tp_plan": (5, 0, 0, 0, 4),
    # parallelize_module on attention and MLP projections only (embedding replicated): 2 x 2 sites
    "torch_parallelize_module_llama": (4, 0, 4, 0, 0),
    "gpt_fast_style": (4, 0, 4, 0, 0),
    # embedding, dense layer (attention, MLP), MoE layer (attention, routed + shared: merged)
    "deepseek_official_style": (6, 1, 4, 1, 0),
}

#: All-reduces left to Inductor (tier c), with the reason `report_compiled` gives: Gemma's scaled embedding
#: multiplies the vocab-parallel sum by sqrt(hidden) before the first norm. (DeepseekV3's shared experts under
#: transformers 5.25's plan: `_moe_plan_sites`.)
LEFT_UNFUSED = {
    "hf_gemma3_tp_plan": [(None, "embedding", "`mul` scales the all-reduced value before the RMSNorm: the fused op "
                           "norms the sum itself (scaling each rank's part before the all-reduce would round "
                           "differently)")],
}
#: transformers 5.25's DeepseekV3 plan: the shared experts' all-reduced output is added to the replicated routed
#: experts' output before the residual add (node names as the rank's compile spells them, blanked).
SHARED_EXPERTS_UNFUSED = (
    r"it is added \(`add(_\d+)?`\) to `\w+`, which is not all-reduced, before the residual add `add(_\d+)?` that the "
    r"RMSNorm reads: the fused op adds the residual to the all-reduced sum itself \(adding `\w+` to the residual "
    r"first would round differently\)")


def _moe_plan_sites(name: str) -> tuple[tuple[int, ...], list]:
    """(expected sites, left unfused as (layer, block, reason pattern)) of a transformers MoE model under the
    installed transformers' TP plan, which changed in 5.25.

    Up to 5.24 the plans shard the routed experts (`packed_colwise` / `rowwise` + `moe_tp_experts`):
    - DeepseekV3 (only the MLPs sharded, MLA attention replicated): embedding, the dense layer's MLP, the MoE
      layer's experts + shared experts (merged, then fused into the final norm);
    - Qwen3-MoE: embedding + 2 x (attention, MoE experts viewed back to [batch, seq, hidden] before the
      residual add; the experts gather the norm's rows by token index, which reads it from memory as a GEMM
      does: tier (a)).
    From 5.25 the routed experts are replicated (no all-reduce):
    - DeepseekV3 shards MLA attention too: embedding + 2 x attention, the dense MLP, and the shared experts,
      whose all-reduced output is added to the routed output before the residual add: left to Inductor;
    - Qwen3-MoE: embedding + 2 x attention.
    """
    import transformers as tf

    config_class = tf.DeepseekV3Config if name == "hf_deepseek_v3_tp_plan" else tf.Qwen3MoeConfig
    if "layers.*.mlp.experts" in config_class.base_model_tp_plan:
        return ((4, 1, 2, 1, 0) if name == "hf_deepseek_v3_tp_plan" else (5, 0, 4, 1, 0)), []
    if name == "hf_deepseek_v3_tp_plan":
        return (5, 0, 3, 1, 0), [(1, "MoE", SHARED_EXPERTS_UNFUSED)]
    return (3, 0, 2, 1, 0), []


def expected(name: str) -> tuple[tuple[int, ...], list]:
    """(sites, all-reduces left unfused as (layer, block, reason pattern)) expected of one model."""
    if EXPECTED_SITES[name] is None:
        return _moe_plan_sites(name)
    return EXPECTED_SITES[name], [(layer, block, re.escape(reason)) for layer, block, reason in LEFT_UNFUSED.get(name, [])]


#: Sites in tier (b): (layer, block) -> the reason `report_compiled` gives, as a pattern. Gemma's sandwich norms
#: feed the residual add.
SANDWICH = (r"its norm's output feeds `add(_\d+)?` \(aten\.add\.Tensor\), which Inductor fuses into the norm's "
            r"kernel and the fused op cannot, so the add and norm stay with Inductor after a fast all-reduce")
TIER_B = {
    "hf_gemma3_tp_plan": {(layer, block): SANDWICH for layer in (0, 1) for block in ("attention", "MLP")},
}


def _tiny_hf_model(name: str, dtype: torch.dtype):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if name in ("hf_llama_tp_plan", "torch_parallelize_module_llama"):
        config = tf.LlamaConfig(intermediate_size=128, num_key_value_heads=2, **common)
        model_class = tf.LlamaForCausalLM
    elif name == "hf_deepseek_v3_tp_plan":
        config = tf.DeepseekV3Config(
            intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **common)
        model_class = tf.DeepseekV3ForCausalLM
    elif name == "hf_gemma3_tp_plan":
        config = tf.Gemma3TextConfig(intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                     **common)
        model_class = tf.Gemma3ForCausalLM
    else:
        config = tf.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2,
                                   head_dim=16, num_experts=4, num_experts_per_tok=2, **common)
        model_class = tf.Qwen3MoeForCausalLM
    torch.manual_seed(0)  # the same full weights on every rank, before each keeps its shard
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith("norm.weight") or "layernorm" in name_:
                param.copy_(1 + 0.1 * torch.randn_like(param, dtype=torch.float32))  # not all ones
    return model


def _apply_hf_tp_plan(model, world_size: int):
    from transformers.distributed import DistributedConfig

    config, _, meshes = model.prepare_distribute_model(DistributedConfig(tp_plan="auto", tp_size=world_size))
    return model.maybe_distribute_model(model, config, meshes)


def _apply_parallelize_module(model, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    plan = {**{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def _build(name: str, dtype: torch.dtype, ctx):
    """(model, forward returning logits) for one case on this rank."""
    import tp_styles

    if name == "gpt_fast_style":
        torch.manual_seed(0)
        model = tp_styles.apply_gpt_fast_tp(tp_styles.GptFastStyle().to(dtype).eval(), ctx.rank, ctx.world_size,
                                            ctx.group)
        return model, model
    if name == "deepseek_official_style":
        torch.manual_seed(0)
        model = tp_styles.DeepSeekOfficialStyle(ctx.rank, ctx.world_size, ctx.group).to(dtype).eval()
        return model, model
    model = _tiny_hf_model(name, dtype)
    if name == "torch_parallelize_module_llama":
        model = _apply_parallelize_module(model, ctx.world_size)
    else:
        model = _apply_hf_tp_plan(model, ctx.world_size)

    def logits(input_ids):
        return model(input_ids=input_ids, use_cache=False).logits

    return model, logits


def _run_case(name: str, dtype: torch.dtype, ctx) -> dict:
    from fxfuse.backend import FxfuseBackend

    _, forward = _build(name, dtype, ctx)
    input_ids = (torch.arange(12).view(2, 6) * 7) % 128
    backend = FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = forward(input_ids)
        compiled = torch.compile(forward, backend=backend, fullgraph=True)(input_ids)
    torch._dynamo.reset()
    (record,) = backend.records
    stats = record.stats
    error = (compiled.float() - eager.float()).abs().max().item() / eager.float().abs().max().item()
    unfused, tier_b = [], {}
    if expected(name)[1] or name in TIER_B:
        from fxfuse.inspect.compiled_report import report_compiled

        with torch.no_grad():
            report = report_compiled(forward, input_ids, fullgraph=True)
        unfused = [(row.layer, row.block, row.reason) for row in report.sites if row.tier == "c"]
        tier_b = {(row.layer, row.block): row.reason for row in report.sites if row.tier == "b"}
    return {
        "sites": (stats.allreduces_before, stats.merged, stats.fused_with_residual, stats.fused_without_residual,
                  stats.fast_all_reduces),
        "allreduces_after": stats.allreduces_after,
        "unfused": unfused,
        "tier_b": tier_b,
        "relative_error": error,
    }


def _grad_enabled_report(ctx) -> dict:
    """`report_compiled` of the transformers Llama (its TP plan) compiled with grad enabled."""
    from fxfuse.inspect.compiled_report import report_compiled

    _, forward = _build("hf_llama_tp_plan", torch.float32, ctx)
    report = report_compiled(forward, (torch.arange(12).view(2, 6) * 7) % 128, fullgraph=True)
    return {"rows": [(row.layer, row.block, row.fused, row.reason) for row in report.sites]}


def _all_cases_on_rank(ctx) -> dict:
    """Every case on this rank; a failing case records its traceback instead of a result."""
    cases = {(name, dtype): (lambda name=name, dtype=dtype: _run_case(name, dtype, ctx))
             for name in EXPECTED_SITES for dtype in DTYPES}
    cases["grad_enabled_report"] = lambda: _grad_enabled_report(ctx)
    results = {}
    for key, case in cases.items():
        try:
            results[key] = case()
        except Exception:  # noqa: BLE001 - each test reports its own case's failure
            results[key] = {"failed": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def results():
    """Rank 0's and rank 1's results of every case (one spawn of 2 gloo ranks)."""
    return run_on_ranks(_all_cases_on_rank, 2, timeout_s=1500)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(EXPECTED_SITES))
def test_every_site_fused_and_numerics(results, name, dtype):
    per_rank = [rank_results[name, dtype] for rank_results in results]
    for result in per_rank:
        assert "failed" not in result, result.get("failed")
    sites, left = expected(name)
    assert [r["sites"] for r in per_rank] == [sites] * 2
    assert [r["allreduces_after"] for r in per_rank] == [len(left)] * 2
    for result in per_rank:
        assert [(layer, block) for layer, block, _ in result["unfused"]] == [(layer, block) for layer, block, _ in left]
        for (_, _, reason), (_, _, pattern) in zip(result["unfused"], left):
            assert re.fullmatch(pattern, reason), reason
    expected_b = TIER_B.get(name, {})
    for result in per_rank:
        assert result["tier_b"].keys() == expected_b.keys()
        for site, reason in result["tier_b"].items():
            assert re.fullmatch(expected_b[site], reason), (site, reason)
    bound = FP32_BOUND if dtype == torch.float32 else MERGED_BF16_BOUND[name] if sites[1] else 0.0
    assert max(r["relative_error"] for r in per_rank) <= bound


def test_grad_enabled_report_names_what_autograd_saves(results):
    """The same Llama compiled with grad enabled: no site fuses, and each row says why and what to do."""
    (result, _) = [rank_results["grad_enabled_report"] for rank_results in results]
    assert "failed" not in result, result.get("failed")
    rows = result["rows"]
    assert [(layer, block, fused) for layer, block, fused, _ in rows] == [
        (None, "embedding", False), (0, "attention", False), (0, "MLP", False), (1, "attention", False),
        (1, "MLP", False)]
    for *_, reason in rows:
        assert re.fullmatch(r"`\w+` \(\w+\) inside the all-reduce -> RMSNorm chain is saved for backward \(grad is "
                            r"enabled\): compile under torch\.no_grad\(\) or torch\.inference_mode\(\)", reason), reason
