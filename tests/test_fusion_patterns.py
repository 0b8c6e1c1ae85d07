"""Patterns 1 and 2 on toy graphs: exact fused counts for every spelling, and every negative case.

Single process with a fake process group (graph shape only; its all-reduce returns the input
unchanged, so the rewritten graph can still be run and compared with the eager program).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.distributed as dist
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from toy_graphs import (
    DECODER_EPS,
    RMSNORMS,
    SAME_ROUNDING,
    GraphCapture,
    compile_and_run,
    decoder_inputs,
    fake_process_group,
    funcol_all_reduce,
    inplace_all_reduce,
    post_grad_graph,
    rmsnorm_functional,
    rmsnorm_gpt_fast,
    rmsnorm_transformers,
    toy_decoder,
)

from fxfuse.op.schema import allreduce_residual_rmsnorm, allreduce_residual_rmsnorm_tensor_eps
from fxfuse.passes import allreduce_rmsnorm_fusion, canonical_form, merge_allreduce
from fxfuse.passes.config import PATTERNS, PassConfig
from fxfuse.passes.pattern_support import same_shape
from fxfuse.passes.unfused_reasons import REDUCE_SCATTER, explain_unfused
from fxfuse.rewrite.graph_diff import op_counts, snapshot

FUSED = "fxfuse.allreduce_residual_rmsnorm"
UNFUSED_OPS = ("_c10d_functional.all_reduce", "_c10d_functional.wait_tensor", "aten.rsqrt", "aten.mean", "aten.pow",
               "aten.sqrt", "aten.reciprocal", "aten.div")


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def fused_sites(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm))


def assert_meta_matches_propagation(gm: torch.fx.GraphModule) -> None:
    """Every node's recorded meta['val'] equals what fake-tensor propagation computes now: same dtypes,
    and shapes provably equal (a view can spell a size `2*(s0//2)` where the graph's guards make it `s0`)."""
    recorded = {node: node.meta.get("val") for node in gm.graph.nodes if node.op == "call_function"}
    inputs = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm, torch._guards.detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and same_shape(a, b)
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return isinstance(a, torch.SymInt) or repr(a) == repr(b)

    for node, value in recorded.items():
        assert value is not None, f"{node} has no meta['val']"
        assert same(value, node.meta["val"]), (node, value, node.meta["val"])


def rewrite_unchanged(fn, *args, reason: str | None) -> None:
    """Assert the pass fuses nothing in fn's graph and changes it no further than its canonical form
    (`canonical_form.canonicalize`), and that `explain_unfused` gives `reason` for each all-reduce left
    (None: there is no all-reduce)."""
    gm = post_grad_graph(fn, *args)
    canonical_form.canonicalize(gm.graph)
    before = snapshot(gm.graph)
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 0
    assert snapshot(gm.graph).lines == before.lines
    left = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
    assert [explain_unfused(node, PassConfig()) for node in left] == [reason] * len(left)
    assert bool(left) == (reason is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", list(RMSNORMS))
def test_every_decoder_site_fused(group, dtype, norm):
    """Embedding (no residual), attention and MLP (both `+` orders, both spellings), last layer."""
    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS[norm])
    inputs = decoder_inputs(dtype)
    backend, fused_out = compile_and_run(decoder, *inputs, backend=GraphCapture(patterns=PATTERNS))
    ((gm,), (record,)) = backend.graphs, backend.records
    assert record.before.op_counts["_c10d_functional.all_reduce"] == 4
    assert (record.stats.fused_without_residual, record.stats.fused_with_residual) == (1, 3)

    gm.graph.lint()
    counts = op_counts(gm.graph)
    assert counts[FUSED] == 4
    assert all(counts[op] == 0 for op in UNFUSED_OPS), counts
    sites = fused_sites(gm)
    assert [site.args[1] is None for site in sites] == [True, False, False, False]
    # each later site's residual is the previous site's residual_out: the add result was redirected
    for previous, site in zip(sites, sites[1:]):
        residual = site.args[1]
        assert residual.target is operator.getitem
        assert residual.args == (previous, 1)
    # F.rms_norm hands eps to the graph rounded to float32
    assert [site.args[3] for site in sites] == pytest.approx(DECODER_EPS, rel=1e-7)
    assert {site.args[4] for site in sites} == {group.group_name}
    assert_meta_matches_propagation(gm)

    if norm in SAME_ROUNDING or dtype == torch.float32:  # the others: test_other_rounding_order
        exact = dtype != torch.float32
        torch.testing.assert_close(fused_out, decoder(*inputs), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", sorted(set(RMSNORMS) - set(SAME_ROUNDING)))
def test_other_rounding_order(group, dtype, norm):
    """Where the model computes 1/sqrt rather than rsqrt, the fused op (rsqrt) may round differently: at
    most one rounding step of the dtype per element."""

    def site(x, res, w):
        h = funcol_all_reduce(x, group) + res
        return RMSNORMS[norm](h, w, 1e-6), h

    inputs = [torch.randn(64, 32, dtype=dtype), torch.randn(64, 32, dtype=dtype), torch.randn(32, dtype=dtype)]
    backend, (normed, residual_out) = compile_and_run(site, *inputs)
    assert backend.records[0].stats.fused == 1
    expected_normed, expected_residual = site(*inputs)
    torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
    # below the smallest normal number rounding steps are absolute, not relative (float16 subnormals)
    finfo = torch.finfo(dtype)
    torch.testing.assert_close(normed, expected_normed, rtol=2 * finfo.eps, atol=finfo.smallest_normal)


def test_run_reports_the_sites_it_rewrote(group):
    decoder = functools.partial(toy_decoder, group=group, norm=rmsnorm_transformers)
    gm = post_grad_graph(decoder, *decoder_inputs(torch.float32))
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 4
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 0


def test_plain_norm_of_reduced_value(group):
    """Pattern 2 where the all-reduced value feeds only the norm."""

    def embed_then_norm(x, w):
        return rmsnorm_transformers(funcol_all_reduce(x, group), w, 1e-6)

    gm = post_grad_graph(embed_then_norm, torch.randn(3, 16), torch.randn(16))
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 1
    (site,) = fused_sites(gm)
    assert site.args[1] is None
    assert op_counts(gm.graph)["_c10d_functional.all_reduce"] == 0


@pytest.mark.slow
def test_symbolic_token_count_and_3d_input(group):
    """[batch, tokens, hidden] activations with dynamic shapes still fuse, with symbolic meta."""
    decoder = functools.partial(toy_decoder, group=group, norm=rmsnorm_functional)
    embed, w_attn, w_mlp, weight = decoder_inputs(torch.bfloat16, tokens=6)
    gm = post_grad_graph(decoder, embed.view(2, 3, -1), w_attn, w_mlp, weight, dynamic=True)
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 4
    x_val = fused_sites(gm)[0].args[0].meta["val"]
    assert any(isinstance(size, torch.SymInt) for size in x_val.shape)
    assert_meta_matches_propagation(gm)


class EpsAttributeDecoder(torch.nn.Module):
    """Pattern 2 then pattern 1, with eps a float attribute (as in every RMSNorm module)."""

    def __init__(self, group, eps: float) -> None:
        super().__init__()
        self.group, self.eps = group, eps

    def forward(self, x, w, norm_weight):
        h = funcol_all_reduce(x, self.group)
        h = funcol_all_reduce(rmsnorm_transformers(h, norm_weight, self.eps) @ w, self.group) + h
        return rmsnorm_transformers(h, norm_weight, self.eps)


def test_eps_attribute_under_dynamic_true(group):
    """dynamic=True turns a float attribute into a graph input (a float64 scalar tensor): every site
    still fuses, through the op's tensor_eps overload, and a changed eps needs no recompile."""
    decoder = EpsAttributeDecoder(group, 1e-6)
    x, w, _, norm_weight = decoder_inputs(torch.float32)
    backend, out = compile_and_run(decoder, x, w, norm_weight, backend=GraphCapture(patterns=PATTERNS), dynamic=True)
    ((gm,), (record,)) = backend.graphs, backend.records
    assert (record.stats.fused_without_residual, record.stats.fused_with_residual, record.stats.allreduces_after) == (1, 1, 0)
    sites = list(gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm_tensor_eps))
    assert len(sites) == 2 and all(site.args[3].meta["val"].device.type == "cpu" for site in sites)
    gm.graph.lint()
    torch.testing.assert_close(out, decoder(x, w, norm_weight), rtol=1e-5, atol=1e-6)

    decoder.eps = 0.5  # large enough to change every output
    with torch.no_grad():
        changed = torch.compile(decoder, backend=backend, fullgraph=True, dynamic=True)(x, w, norm_weight)
    assert len(backend.records) == 1
    torch.testing.assert_close(changed, decoder(x, w, norm_weight), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(changed, out)


def test_rewrite_is_a_pure_function_of_the_graph(group):
    """Two captures of one program rewrite to identical graphs (what every rank relies on)."""
    decoder = functools.partial(toy_decoder, group=group, norm=rmsnorm_transformers)
    afters = []
    for _ in range(2):
        gm = post_grad_graph(decoder, *decoder_inputs(torch.bfloat16))
        allreduce_rmsnorm_fusion.run(gm.graph, PassConfig())
        afters.append(snapshot(gm.graph).lines)
    assert afters[0] == afters[1]


def test_disabled_patterns_fuse_nothing(group):
    decoder = functools.partial(toy_decoder, group=group, norm=rmsnorm_transformers)
    rewrite_patterns = PassConfig(frozenset({"merge_allreduce"}))
    gm = post_grad_graph(decoder, *decoder_inputs(torch.float32))
    assert allreduce_rmsnorm_fusion.run(gm.graph, rewrite_patterns) == 0
    assert op_counts(gm.graph)[FUSED] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("eps", [None, 1e-5], ids=["eps_default", "eps_given"])
def test_torch_rmsnorm_module(group, dtype, eps):
    """`torch.nn.RMSNorm` (eps None: its default, the float32 machine epsilon) fuses with its eps."""
    norm = torch.nn.RMSNorm(32, eps=eps, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32))

    def site(x, res):
        h = funcol_all_reduce(x, group) + res
        return norm(h), h

    inputs = [torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)]
    backend, (normed, residual_out) = compile_and_run(site, *inputs, backend=GraphCapture(patterns=PATTERNS))
    assert backend.records[0].stats.fused_with_residual == 1
    (fused,) = fused_sites(backend.graphs[0])
    assert fused.args[3] == pytest.approx(torch.finfo(torch.float32).eps if eps is None else eps, rel=1e-7)
    expected_normed, expected_residual = site(*inputs)
    torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
    exact = dtype != torch.float32  # F.rms_norm applies the weight in float32, and so does the op it becomes
    torch.testing.assert_close(normed, expected_normed, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)


# ---------------------------------------------------------------- reshapes inside the chain


def assert_fused_like_eager(fn, inputs, *, fused_with_residual=1, fused_without_residual=0, **compile_kwargs):
    """Compile fn, check the exact fused counts, that every fused op sees x and residual of one shape,
    that the graph's meta is right, and that the outputs equal eager (bit for bit: the fake group's
    all-reduce is the identity, and these sites round as the fused op does). Returns the graph."""
    backend, outputs = compile_and_run(fn, *inputs, backend=GraphCapture(patterns=PATTERNS), **compile_kwargs)
    ((gm,), (record,)) = backend.graphs, backend.records
    assert (record.stats.fused_with_residual, record.stats.fused_without_residual) == (
        fused_with_residual, fused_without_residual)
    assert record.stats.allreduces_after == 0
    gm.graph.lint()
    for site in fused_sites(gm) + list(gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm_tensor_eps)):
        x, residual = site.args[0], site.args[1]
        if residual is not None:
            assert x.meta["val"].shape == residual.meta["val"].shape, site
    assert_meta_matches_propagation(gm)
    for got, want in zip(outputs, fn(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return gm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_view_between_all_reduce_and_residual_add(group, dtype):
    """transformers' MoE blocks: the flattened [tokens, hidden] output is all-reduced, then viewed back to
    [batch, seq, hidden] before the residual add. The fused op gets x viewed to the residual's shape."""

    def moe_site(flat, res, w):
        h = res + funcol_all_reduce(flat, group).view(res.shape)
        return rmsnorm_transformers(h, w, 1e-6), h

    inputs = [torch.randn(6, 16, dtype=dtype), torch.randn(2, 3, 16, dtype=dtype), torch.randn(16, dtype=dtype)]
    gm = assert_fused_like_eager(moe_site, inputs)
    (site,) = fused_sites(gm)
    assert site.args[0].target is torch.ops.aten.view.default and list(site.args[0].meta["val"].shape) == [2, 3, 16]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_view_between_residual_add_and_norm(group, dynamic):
    """The norm reads a view of the sum, which is also used (and returned) in its own shape: the chain
    runs in the norm's shape, and the old-shape use reads a view of the fused op's residual_out."""

    def site(x, res, w):
        h = funcol_all_reduce(x, group) + res  # [tokens, hidden]
        n = rmsnorm_transformers(h.view(2, -1, h.shape[-1]), w, 1e-6)
        return n, h * 2

    dtype = torch.bfloat16
    inputs = [torch.randn(6, 16, dtype=dtype), torch.randn(6, 16, dtype=dtype), torch.randn(16, dtype=dtype)]
    gm = assert_fused_like_eager(site, inputs, dynamic=dynamic)
    (fused,) = fused_sites(gm) or gm.graph.find_nodes(op="call_function", target=allreduce_residual_rmsnorm_tensor_eps)
    assert fused.args[0].meta["val"].dim() == 3
    (residual_out,) = [user for user in fused.users if user.args[1] == 1]
    (old_shape,) = residual_out.users
    assert old_shape.target is torch.ops.aten.view.default and old_shape.meta["val"].dim() == 2


def test_unsqueeze_and_squeeze_in_the_chain(group):
    def site(x, res, w):
        h = res.unsqueeze(0) + funcol_all_reduce(x, group).unsqueeze(0)  # [1, tokens, hidden]
        return rmsnorm_gpt_fast(h.squeeze(0), w, 1e-6), h

    dtype = torch.bfloat16
    assert_fused_like_eager(site, [torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype),
                                   torch.randn(16, dtype=dtype)])


def test_view_before_plain_norm(group):
    """Pattern 2 through a view: a vocab-parallel embedding all-reduced flat, viewed, normed."""

    def embed_site(flat, w):
        h = funcol_all_reduce(flat, group).view(2, 3, 16)
        return rmsnorm_transformers(h, w, 1e-6), h

    assert_fused_like_eager(embed_site, [torch.randn(6, 16), torch.randn(16)], fused_with_residual=0,
                            fused_without_residual=1)


# ---------------------------------------------------------------- never fuse what is not the pattern


def test_no_norm_follows(group):
    def reduce_add_sum(x, res):
        return (funcol_all_reduce(x, group) + res).sum(-1)

    rewrite_unchanged(
        reduce_add_sum, torch.randn(4, 16), torch.randn(4, 16),
        reason="no RMSNorm follows the all-reduce or its residual add",
    )


def test_sum_with_an_unreduced_partial_before_the_residual_is_not_fused(group):
    """transformers 5.25's DeepseekV3 plan shards the shared experts only: their all-reduced output is added to
    the replicated routed output, then to the residual, then normed. Fusing would reassociate the sums."""

    def moe_then_norm(shared, routed, res, w):
        return rmsnorm_transformers(res + (routed + funcol_all_reduce(shared, group)), w, 1e-6)

    rewrite_unchanged(
        moe_then_norm, torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16), torch.randn(16),
        reason="it is added (`add`) to `arg1_1`, which is not all-reduced, before the residual add `add_1` that the "
        "RMSNorm reads: the fused op adds the residual to the all-reduced sum itself (adding `arg1_1` to the "
        "residual first would round differently)",
    )


def test_sum_returned_from_the_graph_norm_may_be_in_the_next(group):
    """One graph per decoder block (torchtitan): the MLP's sum ends the graph, its norm starts the next."""

    def reduce_add(x, res):
        return funcol_all_reduce(x, group) + res

    rewrite_unchanged(
        reduce_add, torch.randn(4, 16), torch.randn(4, 16),
        reason="`add` (the all-reduced value plus residual) is returned from the graph and no RMSNorm follows it "
        "here: if the next compiled graph applies the RMSNorm (torch.compile on each decoder block, as torchtitan "
        "does), the norm is in another graph: compile the whole stack as one graph",
    )


def test_add_of_a_broadcast_bias_is_not_a_residual(group):
    def reduce_bias_norm(x, bias, w):
        return rmsnorm_transformers(funcol_all_reduce(x, group) + bias, w, 1e-6)

    rewrite_unchanged(
        reduce_bias_norm, torch.randn(4, 16), torch.randn(16), torch.randn(16),
        reason="residual shape [16] is not the all-reduced shape [4, 16]",
    )


def test_add_of_a_scalar_is_not_a_residual(group):
    def reduce_shift_norm(x, w):
        return rmsnorm_transformers(funcol_all_reduce(x, group) + 1.0, w, 1e-6)

    rewrite_unchanged(reduce_shift_norm, torch.randn(4, 16), torch.randn(16), reason="the residual is not a tensor")


@pytest.mark.parametrize("weight_shape", [(1,), (4, 16)], ids=["scalar_like", "per_token"])
def test_weight_not_a_hidden_size_vector(group, weight_shape):
    def reduce_add_norm(x, res, w):
        h = funcol_all_reduce(x, group) + res
        return rmsnorm_transformers(h, w, 1e-6), h

    rewrite_unchanged(
        reduce_add_norm, torch.randn(4, 16), torch.randn(4, 16), torch.randn(weight_shape),
        reason=f"RMSNorm weight shape {list(weight_shape)} is not [hidden size 16]",
    )


def test_reduced_value_used_elsewhere(group):
    """The fused op cannot return the all-reduced value before the residual add."""

    def reduce_add_norm_keep_reduced(x, res, w):
        reduced = funcol_all_reduce(x, group)
        h = reduced + res
        return rmsnorm_transformers(h, w, 1e-6), h, reduced * 2

    rewrite_unchanged(
        reduce_add_norm_keep_reduced, torch.randn(4, 16), torch.randn(4, 16), torch.randn(16),
        reason="the all-reduced value is also used apart from the residual add",
    )


def test_norm_intermediate_used_elsewhere(group):
    def reduce_norm_keep_rsqrt(x, w):
        h = funcol_all_reduce(x, group)
        inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * (h * inv_rms), inv_rms

    rewrite_unchanged(
        reduce_norm_keep_rsqrt, torch.randn(4, 16), torch.randn(16),
        reason="`rsqrt` (rsqrt) inside the all-reduce -> RMSNorm chain is also a graph output (with grad enabled it "
        "is saved for backward: compile under torch.no_grad() or torch.inference_mode())",
    )


def test_max_all_reduce_is_not_fused(group):
    def reduce_max_norm(x, w):
        return rmsnorm_transformers(torch.distributed._functional_collectives.all_reduce(x, "max", group), w, 1e-6)

    rewrite_unchanged(reduce_max_norm, torch.randn(4, 16), torch.randn(16), reason="reduces with 'max', not a sum")


def test_norm_without_fp32_upcast_is_not_fused(group):
    """A bf16-precision RMSNorm would change numerics if replaced by the fp32 fused op."""

    def reduce_norm_in_bf16(x, res, w):
        h = funcol_all_reduce(x, group) + res
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h

    args = (torch.randn(4, 16), torch.randn(4, 16), torch.randn(16))
    rewrite_unchanged(
        reduce_norm_in_bf16,
        *(a.to(torch.bfloat16) for a in args),
        reason="the RMSNorm of `add` computes in bfloat16, not float32 (no upcast): the fused op's float32 norm "
        "would round differently",
    )


def test_mean_over_tokens_is_not_rmsnorm(group):
    def reduce_norm_over_tokens(x, w):
        h = funcol_all_reduce(x, group)
        return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6))

    rewrite_unchanged(reduce_norm_over_tokens, torch.randn(4, 16), torch.randn(16), reason="no RMSNorm follows")


def test_residual_of_another_dtype(group):
    """A float32 residual added by type promotion, normed in float32 and left float32 (no cast to the
    activations' dtype, as tests/test_norm_spellings.py's float32 residual streams have)."""

    def reduce_add_fp32_residual_norm(x, res, w):
        h = funcol_all_reduce(x, group) + res
        return rmsnorm_transformers(h, w, 1e-6), h

    bf16 = torch.bfloat16
    rewrite_unchanged(
        reduce_add_fp32_residual_norm, torch.randn(4, 16, dtype=bf16), torch.randn(4, 16), torch.randn(16),
        reason="the RMSNorm's result is float32, not the all-reduced bfloat16 the fused op returns",
    )


def test_weight_of_another_dtype(group):
    """fp32 weight times bf16 activations gives an fp32 result the fused op does not produce."""

    def reduce_add_norm(x, res, w):
        h = funcol_all_reduce(x, group) + res
        return rmsnorm_transformers(h, w, 1e-6), h

    bf16 = torch.bfloat16
    x, res = torch.randn(4, 16, dtype=bf16), torch.randn(4, 16, dtype=bf16)
    rewrite_unchanged(
        reduce_add_norm, x, res, torch.randn(16),
        reason="the RMSNorm's result is float32, not the all-reduced bfloat16 the fused op returns",
    )


def test_graph_without_collectives_unchanged(group):
    def local_block(x, res, w):
        h = x @ x.T + res
        return rmsnorm_transformers(h, w, 1e-6), h

    rewrite_unchanged(local_block, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), reason=None)


def test_inplace_all_reduce_of_a_graph_input_is_not_fused(group):
    """The reduced value is also copied back into the caller's tensor: a use the op cannot return."""

    def reduce_input_in_place(x, res, w):
        h = inplace_all_reduce(x, group) + res
        return rmsnorm_transformers(h, w, 1e-6), h

    rewrite_unchanged(
        reduce_input_in_place, torch.randn(4, 16), torch.randn(4, 16), torch.randn(16),
        reason="the all-reduce writes its result back into the graph input `arg0_1` (`copy_`: an in-place all_reduce "
               "of an input): the fused op returns the sum plus the residual and its norm, not the all-reduced value "
               "itself; all-reduce a tensor the function computes (as a row-parallel projection's output), which fuses",
    )


def test_two_groups_each_site_uses_its_own_group(group):
    """Sites on different process groups fuse with their own group's name."""
    other = dist.new_group([0, 1])

    def two_groups(x, y, res, w):
        h = funcol_all_reduce(x, group) + res
        n = rmsnorm_transformers(h, w, 1e-6)
        h = funcol_all_reduce(n @ y, other) + h
        return rmsnorm_transformers(h, w, 1e-6)

    gm = post_grad_graph(two_groups, torch.randn(4, 16), torch.randn(16, 16), torch.randn(4, 16), torch.randn(16))
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 2
    assert [site.args[4] for site in fused_sites(gm)] == [group.group_name, other.group_name]


def test_view_that_changes_the_hidden_dimension(group):
    """A norm over a view that splits the hidden dimension (per head) is not the site's RMSNorm."""

    def reduce_view_norm(x, res, w):
        h = res + funcol_all_reduce(x, group).view(4, 2, 8)
        return rmsnorm_transformers(h, w, 1e-6), h

    rewrite_unchanged(
        reduce_view_norm, torch.randn(4, 16), torch.randn(4, 2, 8), torch.randn(8),
        reason="`view` reshapes the all-reduced value from [4, 16] to [4, 2, 8], changing its last (hidden) dimension",
    )


def test_reduced_value_cast_before_the_residual_add(group):
    """A float32 residual stream whose norm result stays float32 (cast back to bfloat16, it fuses:
    tests/test_norm_spellings.py)."""

    def reduce_cast_add_norm(x, res, w):
        h = funcol_all_reduce(x, group).float() + res
        return rmsnorm_transformers(h, w, 1e-6), h

    rewrite_unchanged(
        reduce_cast_add_norm, torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16), torch.randn(16),
        reason="the RMSNorm's result is float32, not the all-reduced bfloat16 the fused op returns",
    )


def test_all_reduces_of_two_groups_added(group):
    """`ar_g(x) + ar_other(y)` cannot merge; the second fuses with the first as its residual (fusing the
    first would issue its all-reduce after the second's: the order of collectives would change)."""
    other = dist.new_group([0, 1])

    def two_group_sum_norm(x, y, w):
        h = funcol_all_reduce(x, group) + funcol_all_reduce(y, other)
        return rmsnorm_transformers(h, w, 1e-6), h

    gm = post_grad_graph(two_group_sum_norm, torch.randn(4, 16), torch.randn(4, 16), torch.randn(16))
    assert merge_allreduce.run(gm.graph, PassConfig()) == 0
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 1
    (site,) = fused_sites(gm)
    (left,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
    assert (site.args[4], left.args[2]) == (other.group_name, group.group_name)
    assert site.args[1].args[0] is left
    assert explain_unfused(left, PassConfig()) == (
        f"it is the residual of the fused site `{site.name}`, which reduces over another group "
        f"({other.group_name!r}): only sums over one group merge")


def test_reduce_scatter_is_not_fused(group):
    """Sequence parallel: a reduce-scatter, then the residual add and norm on this rank's shard."""

    def scatter_add_norm(x, res, w):
        h = torch.distributed._functional_collectives.reduce_scatter_tensor(x, "sum", 0, group) + res
        return rmsnorm_transformers(h, w, 1e-6), h

    gm = post_grad_graph(scatter_add_norm, torch.randn(8, 16), torch.randn(4, 16), torch.randn(16))
    assert allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 0
    (scatter,) = gm.graph.find_nodes(op="call_function", target=REDUCE_SCATTER)
    assert explain_unfused(scatter, PassConfig()) == (
        "`reduce_scatter_tensor` is a reduce-scatter (sequence parallel), not an all-reduce: the fused op "
        "all-reduces; the RMSNorm `mul_1` that follows runs on this rank's shard")


def test_norm_without_weight(group):
    """An RMSNorm without a weight (elementwise_affine=False): the fused op always multiplies by one."""

    def reduce_add_unweighted_norm(x, res):
        h = funcol_all_reduce(x, group) + res
        return torch.nn.functional.rms_norm(h, (16,), None, 1e-6), h

    rewrite_unchanged(
        reduce_add_unweighted_norm, torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16),
        reason="the RMSNorm `convert_element_type_1` has no weight (the fused op multiplies by one)",
    )


def test_partial_sums_of_two_dtypes_not_merged(group):
    def mixed_partials_add_norm(x, y, res, w):
        h = res + (funcol_all_reduce(x, group) + funcol_all_reduce(y, group))
        return rmsnorm_transformers(h, w, 1e-6), h

    gm = post_grad_graph(mixed_partials_add_norm, torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16),
                         torch.randn(4, 16), torch.randn(16))
    assert merge_allreduce.run(gm.graph, PassConfig()) == allreduce_rmsnorm_fusion.run(gm.graph, PassConfig()) == 0
    left = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
    assert [explain_unfused(node, PassConfig()) for node in left] == [
        "it is added (`add`) to an all-reduce of float32, not bfloat16: no merge",
        "it is added (`add`) to an all-reduce of bfloat16, not float32: no merge",
    ]
