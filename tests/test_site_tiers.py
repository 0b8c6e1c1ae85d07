"""Issue 31: every all-reduce site in one tier. (a) the fused op (with a folded FP8 quantization) where only
GEMMs read the norm; (b) the all-reduce-only op, the add and norm given back to Inductor, where the norm
feeds code Inductor would fuse into it, or no norm follows; (c) Inductor's all-reduce. Exact counts per tier
on hand-written graphs for each kind of epilogue, values bit for bit against eager (fake group: the
collective is the identity in both), then the same with two gloo ranks (real sums), eager and Inductor."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch._inductor.custom_graph_pass import CustomGraphPass
from toy_graphs import GraphCapture, compile_and_run, fake_process_group, rmsnorm_transformers, rmsnorm_weight_in_fp32

from fxfuse.backend import FxfuseBackend
from fxfuse.op.all_reduce_schema import all_reduce
from fxfuse.op.fp8_schema import FP8_OPS
from fxfuse.op.schema import NORM_OPS
from fxfuse.passes.config import FAST_ALLREDUCE, PATTERNS
from fxfuse.passes.site_tiers import TIER_REASON
from fxfuse.runner.launch import run_on_ranks

FP8 = torch.float8_e4m3fn
HIDDEN = 256


def gemm(n):
    return n @ torch.ones(HIDDEN, 8, dtype=n.dtype)


def cast_then_gemm(n):
    """DeepSeek-V3's MoE gate: `F.linear(x.float(), weight.float())`."""
    return n.float() @ torch.ones(HIDDEN, 8)


def clamp_then_scale(n):
    return n.clamp(-2.0, 2.0) * 3.0


def second_rmsnorm(n):
    return rmsnorm_transformers(n, torch.full((HIDDEN,), 0.5, dtype=n.dtype), 1e-5)


def vllm_per_token_fp8(n):
    """vLLM's QuantFP8 per token (folds into the op since issue 29)."""
    scale = (n.abs().max(dim=-1)[0].unsqueeze(-1).float() / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return (n.float() * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def per_tensor_dynamic_fp8(n):
    """A dynamic per-tensor scale (`amax()` with no dim): the op cannot fold it."""
    scale = n.float().abs().amax() / 448.0
    return (n.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


def moe_gather(n):
    """A MoE block's experts: the norm output's rows gathered by token index (`aten.index`), then GEMMs."""
    rows = n.view(-1, HIDDEN)
    return rows[torch.tensor([3, 0, 0, 2])] @ torch.ones(HIDDEN, 8, dtype=n.dtype), gemm(rows)


def gather_only(n):
    """A gather alone reads the norm: Inductor inlines the norm into the gather's kernel."""
    return n.view(-1, HIDDEN)[torch.tensor([3, 0, 0, 2])]


def sandwich_residual_add(n):
    """Gemma's sandwich norm: the residual is added to the norm's output, then the next norm reads the sum."""
    return second_rmsnorm(n + 1.0)


def fp8_and_gate(n):
    """A folded quantization for the experts and the gate's float32 cast reading the same norm output."""
    return (*vllm_per_token_fp8(n), cast_then_gemm(n))


#: Epilogue -> (fused sites, of them with the FP8 quantization folded, all-reduce-only ops).
EPILOGUES = {
    "gemm": (gemm, 1, 0, 0),
    "cast_then_gemm": (cast_then_gemm, 1, 0, 0),  # a cast only a GEMM reads stays with the GEMM
    "moe_gather": (moe_gather, 1, 0, 0),  # with a GEMM reading the norm, the gather is a kernel of its own
    "gather_only": (gather_only, 0, 0, 1),
    "clamp_then_scale": (clamp_then_scale, 0, 0, 1),
    "sandwich_residual_add": (sandwich_residual_add, 0, 0, 1),
    "second_rmsnorm": (second_rmsnorm, 0, 0, 1),
    "vllm_per_token_fp8": (vllm_per_token_fp8, 1, 1, 0),
    "per_tensor_dynamic_fp8": (per_tensor_dynamic_fp8, 0, 0, 1),
    "fp8_and_gate": (fp8_and_gate, 1, 1, 0),
    "fp8_and_clamp": (lambda n: (*vllm_per_token_fp8(n), clamp_then_scale(n)), 0, 0, 1),
}


def block(x, residual, weight, group_name, epilogue, norm=rmsnorm_transformers):
    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    return epilogue(norm(hidden, weight, 1e-6)), hidden


def no_norm_block(x, residual, group_name):
    """An all-reduce with no RMSNorm after it (a LayerNorm follows): fused by nothing."""
    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    return torch.nn.functional.layer_norm(hidden, (HIDDEN,)), hidden


def _inputs(seed: int = 0, dtype=torch.bfloat16, tokens: int = 4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HIDDEN, generator=g).to(dtype), torch.randn(tokens, HIDDEN, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype))


def _flat(out) -> list[torch.Tensor]:
    """The tensors of a (possibly nested) tuple or list of outputs, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for part in out for t in _flat(part)]


def _assert_bit_identical(got, expected, what):
    for g, e in zip(_flat(got), _flat(expected), strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, what
        g, e = (t.view(torch.uint8) if t.dtype == FP8 else t for t in (g, e))
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _tiers(graph: torch.fx.Graph) -> tuple[int, int, int]:
    count = lambda ops: sum(len(graph.find_nodes(op="call_function", target=op)) for op in ops)  # noqa: E731
    return count((*NORM_OPS, *FP8_OPS)), count(FP8_OPS), count((all_reduce,))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", EPILOGUES)
def test_each_epilogue_gets_its_tier_and_the_values_of_eager(name, dynamic):
    epilogue, fused, folded, fast = EPILOGUES[name]
    inputs = _inputs()
    with fake_process_group() as group:
        fn = lambda x, r, w: block(x, r, w, group.group_name, epilogue)  # noqa: E731
        capture, got = compile_and_run(fn, *inputs, backend=GraphCapture(patterns=PATTERNS), dynamic=dynamic)
        expected = fn(*inputs)
    (graph,) = capture.graphs
    assert _tiers(graph.graph) == (fused, folded, fast), name
    decision_tiers = [d.tier for d in capture.site_decisions]
    assert decision_tiers == ["a" if fused else "b"], decision_tiers
    _assert_bit_identical(got, expected, name)


def test_a_tier_b_site_says_what_reads_its_norm():
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, second_rmsnorm), *_inputs(),
                                     backend=GraphCapture(patterns=PATTERNS))
        unfolded, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, per_tensor_dynamic_fp8),
                                      *_inputs(), backend=GraphCapture(patterns=PATTERNS))
    (node,) = capture.graphs[0].graph.find_nodes(op="call_function", target=all_reduce)
    assert "its norm's output feeds `" in node.meta[TIER_REASON] and "Inductor fuses" in node.meta[TIER_REASON]
    (node,) = unfolded.graphs[0].graph.find_nodes(op="call_function", target=all_reduce)
    assert "a quantization the fused op cannot fold" in node.meta[TIER_REASON]
    assert "per-tensor" in node.meta[TIER_REASON], node.meta[TIER_REASON]
    record = capture.records[-1]
    assert record.stats.fast_all_reduces == 1 and record.unfused.fast == 1 and record.unfused.count == 1


def test_the_weight_in_float32_spelling_is_given_back_exactly():
    """`F.rms_norm`'s order (the weight applied in float32 before the cast) comes back as it was."""
    inputs = _inputs(3)
    with fake_process_group() as group:
        fn = lambda x, r, w: block(x, r, w, group.group_name, clamp_then_scale, rmsnorm_weight_in_fp32)  # noqa: E731
        capture, got = compile_and_run(fn, *inputs, backend=GraphCapture(patterns=PATTERNS))
        expected = fn(*inputs)
    assert _tiers(capture.graphs[0].graph) == (0, 0, 1)
    _assert_bit_identical(got, expected, "weight in float32")


def test_an_all_reduce_without_a_norm_gets_the_fast_op_and_keeps_its_reason():
    """On CUDA, where a faster all-reduce may run; on CPU (gloo only) only when forced, as here."""
    inputs = _inputs(1)[:2]
    with fake_process_group() as group:
        fn = lambda x, r: no_norm_block(x, r, group.group_name)  # noqa: E731
        capture, got = compile_and_run(fn, *inputs, backend=GraphCapture(patterns=PATTERNS, fuse_without_fast_kernel=True))
        expected = fn(*inputs)
        unforced, _ = compile_and_run(fn, *inputs, backend=GraphCapture(patterns=PATTERNS))
    assert [d.tier for d in unforced.site_decisions] == ["c"]
    (node,) = capture.graphs[0].graph.find_nodes(op="call_function", target=all_reduce)
    assert "RMSNorm" in node.meta[TIER_REASON], node.meta[TIER_REASON]
    assert [d.tier for d in capture.site_decisions] == ["b"]
    _assert_bit_identical(got, expected, "no norm")


def test_shared_experts_added_to_replicated_routed_experts_get_the_fast_op():
    """transformers 5.25's DeepseekV3 plan: the sharded shared experts' all-reduced output is added to the
    replicated routed experts' output, then to the residual, then normed. Not fusible (another addition order),
    so the fast all-reduce-only op (forced here, as on CPU), with its reason, and eager's values."""
    shared, residual, weight = _inputs(2)
    routed = _inputs(3)[0]

    def moe_layer_end(shared, routed, residual, weight, group_name):
        hidden = residual + (routed + funcol.all_reduce(shared, "sum", group_name))
        return rmsnorm_transformers(hidden, weight, 1e-6), hidden

    with fake_process_group() as group:
        fn = lambda *args: moe_layer_end(*args, group.group_name)  # noqa: E731
        capture, got = compile_and_run(fn, shared, routed, residual, weight,
                                       backend=GraphCapture(patterns=PATTERNS, fuse_without_fast_kernel=True))
        expected = fn(shared, routed, residual, weight)
    assert _tiers(capture.graphs[0].graph) == (0, 0, 1)
    (node,) = capture.graphs[0].graph.find_nodes(op="call_function", target=all_reduce)
    assert "which is not all-reduced, before the residual add" in node.meta[TIER_REASON], node.meta[TIER_REASON]
    _assert_bit_identical(got, expected, "shared + routed experts")


@pytest.mark.parametrize("name", ["clamp_then_scale", "per_tensor_dynamic_fp8"])
def test_without_the_fast_allreduce_pattern_there_is_no_tier_b(name):
    """Without `fast_allreduce` the old behaviour: the site stays fused, whatever follows."""
    patterns = [p for p in PATTERNS if p != FAST_ALLREDUCE]
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x, r, w: block(x, r, w, group.group_name, EPILOGUES[name][0]), *_inputs(),
                                     backend=GraphCapture(patterns=patterns))
    assert _tiers(capture.graphs[0].graph) == (1, 0, 0)


def _producer_block(inp, residual, weight, proj, group_name):
    """`block` after a GEMM, whose output the all-reduce may overwrite (it has no other reader)."""
    return block(inp @ proj, residual, weight, group_name, clamp_then_scale)


def _without_graph_id(code: str) -> str:
    """Generated code without its `# AOT ID` line (which numbers the graphs a process compiled)."""
    return re.sub(r"^# AOT ID: .*$", "", code, flags=re.M)


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_reduces_a_tier_b_gemm_output_in_place_without_a_copy(dynamic, monkeypatch):
    """The all-reduce-only op writes the GEMM's output itself, as Inductor's own all-reduce does: no copy
    kernel before it, even where Inductor does not re-derive the pass's fake values before re-inplacing
    (torch 2.11: the copy made a tier-(b) site up to 1.44x Inductor's time on an H200, 1.73x dynamic).
    Emulated on this torch by making that update a no-op; Inductor's generated code then has one kernel
    (add, norm, clamp, scale), the very kernel it generates for its own graph (same name and source, so
    the same autotuning-cache entry: with other names the H200 tuned the two variants' kernels apart, into
    launch configurations 0.7x to 1.18x apart), and its values are those of Inductor's own code for the
    unfused block, bit for bit."""
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(FakeTensorUpdater, "incremental_update", lambda self: None)
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # the passes must run, not a cached graph
    g = torch.Generator().manual_seed(1)
    inp, proj = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(64, HIDDEN, generator=g).bfloat16()
    _, residual, weight = _inputs(tokens=8)
    with fake_process_group() as group:
        backend = FxfuseBackend(fuse_without_fast_kernel=True)
        fn = torch.compile(_producer_block, backend=backend, fullgraph=True, dynamic=dynamic)
        torch._dynamo.reset()
        with torch.no_grad():
            out, codes = run_and_get_code(fn, inp, residual, weight, proj, group.group_name)
            torch._dynamo.reset()
            inductor = torch.compile(_producer_block, backend="inductor", fullgraph=True, dynamic=dynamic)
            expected, inductor_codes = run_and_get_code(inductor, inp, residual, weight, proj, group.group_name)
    (record,) = backend.records
    assert record.stats.fast_all_reduces == 1
    kernels, call = codes[-1].split("def call(")
    call = call[:call.index("return (")]
    assert "fxfuse.all_reduce_.default(buf0," in call, call  # the GEMM's output buffer itself
    assert "clone" not in call and "copy_(" not in call, call
    assert re.findall(r"^\s+(cpp_fused\w*)\(", call, re.M) == ["cpp_fused__to_copy_add_clamp_mean_mul_pow_rsqrt_0"], call
    assert _without_graph_id(kernels) == _without_graph_id(inductor_codes[-1].split("def call(")[0])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class _NodeOrigins(CustomGraphPass):
    """A post-grad pass that keeps (target, original_aten) of each call the graph makes, the collectives aside."""

    COLLECTIVES = ("_c10d_functional", "fxfuse.all_reduce", "auto_functionalized", "getitem")

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, str]]] = []

    def __call__(self, graph: torch.fx.Graph, *args, **kwargs) -> None:
        self.seen.append(sorted((str(n.target), str(n.meta.get("original_aten"))) for n in graph.nodes
                                if n.op == "call_function" and not any(c in str(n.target) for c in self.COLLECTIVES)))

    def uuid(self) -> str:
        return "test-node-origins"


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_tier_b_site_gives_inductor_the_nodes_of_its_own_graph(dynamic, monkeypatch):
    """Inductor names a kernel after its nodes' `original_aten` and keys its autotuning by the kernel's source,
    name included: tier (b)'s add and norm carry those of Inductor's own graph, node for node, so Inductor
    generates, names and tunes the same kernels (on the H200, without them, the two variants' kernels of the
    bench's UE8M0 block were tuned apart and ran 0.69x to 1.35x apart under dynamic shapes). That block has a
    second reduction after the norm (a kernel of its own on GPUs), and under dynamic shapes Inductor's own
    passes leave its eps add without `original_aten`."""
    from torch._inductor import config as inductor_config
    import fxfuse.post_grad as post_grad
    from fxfuse.bench.fallback_blocks import BLOCKS, block_inputs

    inputs = block_inputs("group_ue8m0", 8, 256, torch.device("cpu"))
    inductor_origins, fxfuse_origins = _NodeOrigins(), _NodeOrigins()
    donate = post_grad.donate_allreduce_input.run

    def donate_then_record(graph):
        donate(graph)
        fxfuse_origins(graph)

    monkeypatch.setattr(post_grad.donate_allreduce_input, "run", donate_then_record)
    with fake_process_group() as group, torch.no_grad(), inductor_config.patch(force_disable_caches=True):  # passes run
        torch._dynamo.reset()
        backend = FxfuseBackend(patterns=[p for p in PATTERNS if p != "fp8_epilogue"], fuse_without_fast_kernel=True)
        torch.compile(BLOCKS["group_ue8m0"], backend=backend, fullgraph=True, dynamic=dynamic)(*inputs, group.group_name)
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_post_pass=inductor_origins):
            torch.compile(BLOCKS["group_ue8m0"], backend="inductor", fullgraph=True, dynamic=dynamic)(*inputs, group.group_name)
    (record,) = backend.records
    assert record.stats.fast_all_reduces == 1 and not record.stats.fused
    assert fxfuse_origins.seen == inductor_origins.seen
    assert ("aten.rsqrt.default", "aten.rsqrt.default") in fxfuse_origins.seen[0]


def test_other_reductions_stay_inductors():
    """Tier (c): a max all-reduce is not the op's to run."""
    with fake_process_group() as group:
        capture, _ = compile_and_run(lambda x: funcol.all_reduce(x, "max", group.group_name) * 2, _inputs()[0],
                                     backend=GraphCapture(patterns=PATTERNS))
    assert _tiers(capture.graphs[0].graph) == (0, 0, 0) and [d.tier for d in capture.site_decisions] == ["c"]


def _gemm_output_read_again(inp, residual, weight, proj, group_name):
    """`_producer_block`, and the GEMM's output read after the all-reduce: the op must not write it."""
    x = inp @ proj
    return block(x, residual, weight, group_name, clamp_then_scale), x * 2


#: Blocks whose all-reduced x is a GEMM's output (written in place, or copied where it is read again) ->
#: their tier-(b) op count, for the two-rank check beside `EPILOGUES`.
GEMM_BLOCKS = {"gemm_output_reduced_in_place": (_producer_block, 1), "gemm_output_read_again": (_gemm_output_read_again, 1)}


def _compiled_vs_eager_on_rank(ctx, inner: str) -> list:
    """Every epilogue and GEMM block, compiled (all patterns) and eager, on real two-rank sums."""
    group_name = ctx.group.group_name
    results = []
    cases = {name: (lambda x, r, w, e=epilogue: block(x, r, w, group_name, e), _inputs(10 + ctx.rank))
             for name, (epilogue, *_) in EPILOGUES.items()}
    g = torch.Generator().manual_seed(20 + ctx.rank)
    gemm_inputs = (torch.randn(4, 64, generator=g).bfloat16(), *_inputs(10 + ctx.rank)[1:],
                   torch.randn(64, HIDDEN, generator=g).bfloat16())
    cases |= {name: (lambda *a, f=fn: f(*a, group_name), gemm_inputs) for name, (fn, _) in GEMM_BLOCKS.items()}
    for name, (fn, inputs) in cases.items():
        backend = FxfuseBackend(inner=inner)
        _, got = compile_and_run(fn, *inputs, backend=backend)
        results.append((name, _picklable(got), _picklable(fn(*inputs)), backend.records[-1].stats.fast_all_reduces))
    return results


def _picklable(out) -> list[torch.Tensor]:
    """The outputs with FP8 ones as their bytes (FP8 storages do not cross processes)."""
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in _flat(out)]


def _check_ranks(outputs, inner: str) -> None:
    for rank_results in outputs:
        for name, got, expected, fast in rank_results:
            assert fast == (GEMM_BLOCKS[name][1] if name in GEMM_BLOCKS else EPILOGUES[name][3]), (inner, name, fast)
            if inner == "eager":
                _assert_bit_identical(got, expected, name)
            else:  # Inductor's own code for the norm and what follows: its rounding, within bf16 / one e4m3 step
                for g, e in zip(got, expected, strict=True):
                    fp8 = g.dtype == torch.uint8
                    g, e = (t.view(FP8).float() if fp8 else t.float() for t in (g, e))
                    tolerance = {"rtol": 0.126, "atol": 2.0**-9} if fp8 else {"rtol": 0.02, "atol": 0.02}
                    torch.testing.assert_close(g, e, **tolerance, msg=lambda m: f"{name}: {m}")


def test_two_gloo_ranks_compiled_equal_eager_eager_inner():
    _check_ranks(run_on_ranks(_compiled_vs_eager_on_rank, 2, "eager", timeout_s=300), "eager")


@pytest.mark.slow
def test_two_gloo_ranks_compiled_equal_eager_inductor_inner():
    """Under Inductor the all-reduce-only op becomes `auto_functionalized(all_reduce_)` and is re-inplaced."""
    _check_ranks(run_on_ranks(_compiled_vs_eager_on_rank, 2, "inductor", timeout_s=900), "inductor")
