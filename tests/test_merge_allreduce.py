"""Pattern 3: `all_reduce(a) + all_reduce(b)` on one group -> `all_reduce(a + b)`, then pattern 1.

Single process with a fake process group (graph shape only).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from toy_graphs import (
    GraphCapture,
    compile_and_run,
    deepseek_moe_block,
    fake_process_group,
    funcol_all_reduce,
    inplace_all_reduce,
    post_grad_graph,
    rmsnorm_transformers,
)

from fxfuse.passes import canonical_form, merge_allreduce
from fxfuse.passes.config import MERGE_ALLREDUCE, PATTERNS, PassConfig
from fxfuse.passes.unfused_reasons import explain_unfused
from fxfuse.rewrite.graph_diff import op_counts, snapshot

ALL_REDUCE = "_c10d_functional.all_reduce"


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def moe_inputs(dtype=torch.bfloat16):
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    w_routed, w_shared = torch.randn(32, 32, dtype=dtype), torch.randn(32, 32, dtype=dtype)
    return x, residual, w_routed, w_shared, torch.randn(32, dtype=dtype)


def merge_unchanged(fn, *args) -> None:
    """Assert the merge pass finds nothing in fn's graph and changes it no further than its canonical form."""
    gm = post_grad_graph(fn, *args)
    canonical_form.canonicalize(gm.graph)
    before = snapshot(gm.graph)
    assert merge_allreduce.run(gm.graph, PassConfig()) == 0
    assert snapshot(gm.graph).lines == before.lines


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_deepseek_shared_experts_merged_then_fused(group, dtype):
    """Routed + shared partial sums reduce once, and that all-reduce fuses with residual + norm."""
    block = functools.partial(deepseek_moe_block, group=group)
    backend, (normed, residual_out) = compile_and_run(block, *moe_inputs(dtype), backend=GraphCapture(PATTERNS))
    (record,) = backend.records
    assert record.stats.allreduces_before == 2
    assert record.stats.merged == 1
    assert record.stats.fused_with_residual == 1
    assert record.stats.allreduces_after == 0
    # the fused op reduces the local sum of both partial outputs
    (gm,) = backend.graphs
    (site,) = gm.graph.find_nodes(op="call_function", target=torch.ops.fxfuse.allreduce_residual_rmsnorm.default)
    assert op_counts(gm.graph)["aten.mm"] == 2
    assert site.args[0].target is torch.ops.aten.add.Tensor
    assert {arg.target for arg in site.args[0].args} == {torch.ops.aten.mm.default}


def test_merge_rewrites_to_one_allreduce_of_the_sum(group):
    block = functools.partial(deepseek_moe_block, group=group)
    gm = post_grad_graph(block, *moe_inputs())
    assert merge_allreduce.run(gm.graph, PassConfig()) == 1
    gm.graph.lint()
    (reduce,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
    summed, op, group_name = reduce.args
    assert (summed.target, op, group_name) == (torch.ops.aten.add.Tensor, "sum", group.group_name)
    assert reduce.meta["val"].shape == summed.meta["val"].shape
    assert op_counts(gm.graph)["_c10d_functional.wait_tensor"] == 1


def test_three_partial_sums_merge_into_one(group):
    def three_way(x, w1, w2, w3):
        return funcol_all_reduce(x @ w1, group) + funcol_all_reduce(x @ w2, group) + inplace_all_reduce(x @ w3, group)

    gm = post_grad_graph(three_way, torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    assert merge_allreduce.run(gm.graph, PassConfig()) == 2
    assert op_counts(gm.graph)[ALL_REDUCE] == 1


def test_merge_disabled_leaves_both_and_blocks_fusion(group):
    """Without the merge, `residual + (ar(a) + ar(b))` is not pattern 1: nothing changes."""
    block = functools.partial(deepseek_moe_block, group=group)
    enabled = [p for p in PATTERNS if p != MERGE_ALLREDUCE]
    backend, _ = compile_and_run(block, *moe_inputs(), backend=GraphCapture(enabled))
    (record,) = backend.records
    assert (record.stats.merged, record.stats.fused, record.stats.allreduces_after) == (0, 0, 2)
    assert record.after.op_counts == record.before.op_counts
    (gm,) = backend.graphs
    reasons = {explain_unfused(node, PassConfig(frozenset(enabled)))
               for node in gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)}
    assert reasons == {"it is added to another all-reduce (`add`) and pattern merge_allreduce is disabled"}


def test_different_groups_not_merged(group):
    other = dist.new_group([0, 1])

    def two_groups(x, y):
        return funcol_all_reduce(x, group) + funcol_all_reduce(y, other)

    merge_unchanged(two_groups, torch.randn(4, 8), torch.randn(4, 8))


def test_broadcast_partial_not_merged(group):
    def broadcast_sum(x, bias):
        return funcol_all_reduce(x, group) + funcol_all_reduce(bias, group)

    merge_unchanged(broadcast_sum, torch.randn(4, 8), torch.randn(8))


def test_mixed_dtypes_not_merged(group):
    def mixed(x, y):
        return funcol_all_reduce(x, group) + funcol_all_reduce(y, group)

    merge_unchanged(mixed, torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8))


def test_partial_result_used_elsewhere_not_merged(group):
    def keep_one(x, y):
        routed = funcol_all_reduce(x, group)
        return routed + funcol_all_reduce(y, group), routed * 2

    merge_unchanged(keep_one, torch.randn(4, 8), torch.randn(4, 8))


def test_max_reductions_not_merged(group):
    def max_reduce(x, y):
        reduce_max = torch.distributed._functional_collectives.all_reduce
        return reduce_max(x, "max", group) + reduce_max(y, "max", group)

    merge_unchanged(max_reduce, torch.randn(4, 8), torch.randn(4, 8))


# ---------------------------------------------------------------- reshapes between the all-reduces and their sum


def official_moe_layer(x, residual, w_routed, w_shared, norm_weight, *, group):
    """DeepSeek's official inference MoE: flatten, reduce the routed sum in place and the shared experts'
    row-parallel output on its own, `(y + z).view(shape)`; then the block's residual add and the next
    norm (F.rms_norm, as its RMSNorm)."""
    shape = x.size()
    flat = x.view(-1, shape[-1])
    y = flat @ w_routed
    torch.distributed.all_reduce(y, group=group)
    z = inplace_all_reduce(flat @ w_shared, group)
    h = residual + (y + z).view(shape)
    return torch.nn.functional.rms_norm(h, (shape[-1],), norm_weight, 1e-6), h


def transformers_moe_layer(x, residual, w_routed, w_shared, norm_weight, *, group):
    """transformers' DeepseekV3MoE under its tp_plan: the experts' flat output is all-reduced and viewed
    back before the shared experts' all-reduced output is added; then residual add and norm."""
    shape = x.shape
    routed = funcol_all_reduce(x.view(-1, shape[-1]) @ w_routed, group).view(*shape)
    h = residual + (routed + funcol_all_reduce(x @ w_shared, group))
    return rmsnorm_transformers(h, norm_weight, 1e-6), h


@pytest.mark.parametrize("layer", [official_moe_layer, transformers_moe_layer], ids=["official", "transformers"])
def test_views_around_the_partial_sums_merge_then_fuse(group, layer):
    block = functools.partial(layer, group=group)
    x, residual, w_routed, w_shared, weight = moe_inputs(torch.float32)
    inputs = (x.view(1, 5, 32), residual.view(1, 5, 32), w_routed, w_shared, weight)
    backend, (normed, residual_out) = compile_and_run(block, *inputs, backend=GraphCapture(PATTERNS))
    (record,) = backend.records
    assert (record.stats.allreduces_before, record.stats.merged, record.stats.fused_with_residual,
            record.stats.allreduces_after) == (2, 1, 1, 0)
    (gm,) = backend.graphs
    (site,) = gm.graph.find_nodes(op="call_function", target=torch.ops.fxfuse.allreduce_residual_rmsnorm.default)
    assert [list(arg.meta["val"].shape) for arg in site.args[:2]] == [[1, 5, 32], [1, 5, 32]]
    expected_normed, expected_residual = block(*inputs)
    torch.testing.assert_close(residual_out, expected_residual, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-5)
