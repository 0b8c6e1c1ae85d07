"""Wrong answers and crashes of the passes found by differential fuzzing (issue 21, items 11-14 and 16).

Each program here was compiled wrong, or failed to compile, before its fix. Single process with a fake
process group (its all-reduce returns the input unchanged), so a compiled program must equal eager bit
for bit; every compile goes through `OrderCheckedBackend`, which also checks that no collective moved
later or changed places. Sites the passes must leave alone are checked with `explain_unfused`'s
reason for them. One slow test runs item 16's graph under Inductor on two gloo ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from collective_order import CollectiveOrder, OrderCheckedBackend, compiled_like_eager
from toy_graphs import fake_process_group, post_grad_graph

from fxfuse.passes import canonical_form
from fxfuse.passes.config import PassConfig
from fxfuse.passes.unfused_reasons import explain_unfused
from fxfuse.runner.launch import run_on_ranks

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
H = 16


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def ar(x, group):
    return funcol.all_reduce(x, "sum", group)


def normalized(h, eps=1e-6):
    """transformers' RMSNorm without its weight: float32 statistic, cast back."""
    c = h.float()
    return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def rmsnorm(h, w, eps=1e-6):
    return normalized(h, eps) * w


def unfused_reasons(gm) -> list[str]:
    return [explain_unfused(node, PassConfig()) for node in gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)]


def inputs(*shapes, dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype) for shape in shapes]


# ---------------------------------------------------------------- item 11: alpha on an add of the chain


def test_alpha_on_residual_add_with_the_residual_first_is_kept(group):
    """`torch.add(r, ar(y), alpha=2)` is `r + 2 ar(y)`: swapping the operands made it `ar(y) + 2 r`."""

    def scaled_reduced(y, r):
        return torch.add(r, ar(y, group), alpha=2.0)

    compiled_like_eager(scaled_reduced, *inputs((4, H), (4, H)))


@pytest.mark.parametrize("residual_first", [False, True], ids=["reduced_first", "residual_first"])
def test_alpha_on_residual_add_before_a_norm_is_not_fused(group, residual_first):
    def site(y, r, w):
        h = torch.add(r, ar(y, group), alpha=2.0) if residual_first else torch.add(ar(y, group), r, alpha=2.0)
        return rmsnorm(h, w), h

    gm = compiled_like_eager(site, *inputs((4, H), (4, H), (H,)))
    assert unfused_reasons(gm) == ["`add` (add) is called with alpha=2.0, which the fused op does not reproduce"]


def test_alpha_on_the_eps_add_is_not_fused(group):
    """`torch.add(var, 0.5, alpha=4.0)` adds 2.0, not 0.5."""

    def site(y, r, w):
        h = ar(y, group) + r
        c = h.float()
        inverse = torch.rsqrt(torch.add(c.pow(2).mean(-1, keepdim=True), 0.5, alpha=4.0))
        return (c * inverse).to(h.dtype) * w, h

    gm = compiled_like_eager(site, *inputs((4, H), (4, H), (H,)))
    assert unfused_reasons(gm) == ["`add_1` (add) is called with alpha=4.0, which the fused op does not reproduce"]


# ---------------------------------------------------------------- item 12: alpha on the merge add


def test_alpha_on_the_sum_of_two_all_reduces_is_not_merged(group):
    def scaled_sum(a, b):
        return torch.add(ar(a, group), ar(b, group), alpha=2.0)

    compiled_like_eager(scaled_sum, *inputs((4, H), (4, H)))


def test_alpha_on_the_sum_before_residual_and_norm_says_why(group):
    def block(a, b, r, w):
        h = r + torch.add(ar(a, group), ar(b, group), alpha=2.0)
        return rmsnorm(h, w), h

    gm = compiled_like_eager(block, *inputs((4, H), (4, H), (4, H), (H,)))
    assert unfused_reasons(gm) == ["it is added to another all-reduce by `add`, which is called with alpha=2.0: no merge"] * 2


# ---------------------------------------------------------------- item 13: a mean in another dtype


@pytest.mark.parametrize("upcast", [False, True], ids=["float32", "upcast_bf16"])
def test_mean_in_float64_is_not_fused(group, upcast):
    """`mean(..., dtype=torch.float64)` makes the norm (and its output) float64."""
    dtype = torch.bfloat16 if upcast else torch.float32

    def site(y, r, w):
        h = ar(y, group) + r
        c = h.float()
        variance = c.pow(2).mean(-1, keepdim=True, dtype=torch.float64)
        return (c * torch.rsqrt(variance + 1e-6)).to(h.dtype) * w, h

    gm = compiled_like_eager(site, *inputs((4, H), (4, H), (H,), dtype=dtype))
    assert unfused_reasons(gm) == [
        "`mean` (mean) is called with dtype=torch.float64, which the fused op does not reproduce"]


def test_mean_in_its_own_dtype_still_fuses(group):
    def site(y, r, w):
        h = ar(y, group) + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + 1e-6) * w, h

    compiled_like_eager(site, *inputs((4, H), (4, H), (H,)), fused=1)


# ---------------------------------------------------------------- item 14: inputs computed from the site


def test_weight_computed_from_the_sum(group):
    def site(y, r):
        h = ar(y, group) + r
        return h[0] * normalized(h), h

    gm = compiled_like_eager(site, *inputs((4, H), (4, H)))
    assert unfused_reasons(gm) == [
        "the RMSNorm weight `select` is computed from `add` inside the all-reduce -> RMSNorm chain (the fused op would need its own result)"]


def test_eps_computed_from_the_sum(group):
    def site(y, r, w):
        h = ar(y, group) + r
        c = h.float()
        eps = h.abs().mean() * 1e-3
        return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * w, h

    gm = compiled_like_eager(site, *inputs((4, H), (4, H), (H,)))
    assert unfused_reasons(gm) == [
        "the eps `mul` is computed from `add` inside the all-reduce -> RMSNorm chain (the fused op would need its own result)"]


def test_weight_a_row_of_the_tensor_all_reduced_in_place(group):
    def embedding_site(x, wm):
        y = x @ wm
        dist.all_reduce(y, group=group)
        return rmsnorm(y, y[0]), y

    gm = compiled_like_eager(embedding_site, *inputs((4, H), (H, H)))
    assert unfused_reasons(gm) == [
        "the RMSNorm weight `select_1` is computed from `wait_tensor` inside the all-reduce -> RMSNorm chain (the fused op would need its own result)"]


def test_eps_computed_late_but_not_from_the_site_still_fuses(group):
    """An input computed after the all-reduce from values known before it moves up: the fused op is
    issued where the all-reduce was."""

    def site(y, r, w, e):
        h = ar(y, group) + r
        eps = e.sum() * 1e-3
        c = h.float()
        return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * w, h

    compiled_like_eager(site, *inputs((4, H), (4, H), (H,), (3,)), fused=1)


# ---------------------------------------------------------------- item 16: collectives keep their order and place


def two_all_reduces_then_a_view(p, r, w, q, wq, *, group):
    """The first all-reduce's sum is reshaped after a second all-reduce was issued."""
    first = ar(p, group)
    second = ar(q @ wq, group)
    h = r + first.unsqueeze(0)
    return rmsnorm(h, w), second


def test_canonical_form_keeps_a_reshaped_all_reduce_in_place(group):
    """`unsqueeze(ar(p))` becomes `ar(unsqueeze(p))` issued where `ar(p)` was, before the second."""
    gm = post_grad_graph(lambda *a: two_all_reduces_then_a_view(*a, group=group), *inputs((4, H), (1, 4, H), (H,),
                                                                                           (4, H), (H, H)))
    order = CollectiveOrder.record(gm.graph)
    assert canonical_form.canonicalize(gm.graph) > 0
    gm.graph.lint()
    order.check(gm.graph)
    first, _ = gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)
    assert first.args[0].target is torch.ops.aten.unsqueeze.default


def test_fused_op_issued_where_its_all_reduce_was(group):
    compiled_like_eager(lambda *a: two_all_reduces_then_a_view(*a, group=group),
                        *inputs((4, H), (1, 4, H), (H,), (4, H), (H, H)), fused=1)


def test_merged_all_reduce_issued_where_the_later_one_was(group):
    """`ar(a) + ar(b)` with work between the two all-reduces and their sum: the merged all-reduce goes
    where `ar(b)` was, before the unrelated all-reduce on the other group."""
    other = dist.new_group([0, 1])

    def block(a, b, c, r, w):
        routed = ar(a, group)
        shared = ar(b, group)
        elsewhere = ar(c @ c.T, other)
        h = r + (routed + shared)
        return rmsnorm(h, w), h, elsewhere

    compiled_like_eager(block, *inputs((4, H), (4, H), (4, H), (4, H), (H,)), fused=1, merged=1)


def test_merge_leaves_a_later_all_reduce_of_a_partial_in_place(group):
    """An all-reduce of a value computed from a merged partial sum stays after the merged all-reduce."""

    def block(a, b, w, r, nw):
        routed = ar(a, group)
        shared = ar(b * 2, group)
        third = ar(a @ w, group)  # issued before the sum: the merged all-reduce is not its original
        h = r + (routed + shared)
        return rmsnorm(h, nw), h, third

    compiled_like_eager(block, *inputs((4, H), (4, H), (H, H), (4, H), (H,)), fused=1, merged=1)


def test_no_merge_across_another_collective(group):
    """A collective issued between the two all-reduces stays between them: no merge, with the reason."""
    other = dist.new_group([0, 1])

    def block(a, b, c, r, w):
        routed = ar(a, group)
        elsewhere = ar(c @ c.T, other)
        shared = ar(b, group)
        h = r + (routed + shared)
        return rmsnorm(h, w), h, elsewhere

    gm = compiled_like_eager(block, *inputs((4, H), (4, H), (4, H), (4, H), (H,)))
    assert unfused_reasons(gm)[0::2] == [
        "it is added (`add`) to another all-reduce, and `all_reduce_1` is issued between the two: merging would "
        "change the order of collectives"] * 2


def viewed_site_then_inplace_add(p, r, w, wo, x, wm, *, group):
    """Issue 21's minimal graph for item 16: a viewed sum's norm, then an in-place add of a second
    all-reduce, unsqueezed. Canonicalizing it issued the second all-reduce late, and Inductor then read
    its buffer before its wait_tensor (wrong every run)."""
    h = ar(p, group).view(1, -1, p.shape[-1]) + r
    o = rmsnorm(h, w) @ wo
    h.add_(ar(x @ wm, group).unsqueeze(0))
    return o, h


def _item16_under_inductor(ctx, calls: int):
    gen = torch.Generator().manual_seed(ctx.rank)
    args = [torch.randn(shape, generator=gen) for shape in ((4, H), (1, 4, H), (H,), (H, H), (4, H), (H, H))]
    program = functools.partial(viewed_site_then_inplace_add, group=ctx.group)
    backend = OrderCheckedBackend(inner="inductor")
    compiled = torch.compile(program, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = program(*[a.clone() for a in args])
        results = [compiled(*[a.clone() for a in args]) for _ in range(calls)]
    return expected, results, backend.records[-1].stats.fused


@pytest.mark.slow
def test_reshaped_all_reduce_under_inductor_on_two_ranks():
    for expected, results, fused in run_on_ranks(_item16_under_inductor, 2, 5, timeout_s=600):
        assert fused == 1
        for got in results:
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- independent sites with nothing left between them


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float32)], ids=["fp16-fp32", "fp32-fp32"])
def test_two_independent_sites_keep_their_order(group, dtypes):
    """Two independent all-reduce -> add -> RMSNorm chains, the second's all-reduce right after the first
    chain: once both chains are replaced, nothing alive stands between the two all-reduces' places. Each
    fused op is still issued in its all-reduce's turn (found by fuzzing cases compiled together; before
    the fix the second site's fused op was issued first)."""

    def two_sites(x, r, w, y, s, v):
        h = ar(x, group) + r
        g = ar(y, group) + s
        return rmsnorm(h, w), h, rmsnorm(g, v), g

    first, second = dtypes
    compiled_like_eager(two_sites, *inputs((4, H), (4, H), (H,), dtype=first), *inputs((2, H), (2, H), (H,), dtype=second),
                        fused=2)


def test_a_site_after_one_whose_float32_weight_is_taken_apart_keeps_its_order(group):
    """The first site applies `w.float()` (moved up with its fused op, then erased when the op takes the
    16-bit weight): the second site's fused op still comes after the first's."""

    def two_sites(x, w, y, s, v):
        h = ar(x, group)
        c = h.float()
        first = ((c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()).to(h.dtype)
        g = s + ar(y, group)
        return first, h, rmsnorm(g, v), g

    gm = compiled_like_eager(two_sites, *inputs((4, H), (H,), (4, H), (4, H), (H,), dtype=torch.float16), fused=2)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.prims.convert_element_type.default)
