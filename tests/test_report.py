"""`fxfuse report`: every all-reduce site of a model with its layer, block, fused or why not, traced on
fake tensors with a fake process group; and the golden graph diff of the tiny model at tp=2.

Golden file: tests/golden/tiny_tp2.diff is `render_diff` of the tiny preset's post-grad graph (4 layers,
tp=2, bfloat16, dynamic shapes) before and after the fxfuse passes. What the passes changed is compared
exactly: the op counts and every removed and added line; the context around them (unchanged lines, and
where the hunks start) is not, since it is the rest of the model as torch traces it (torch 2.15 traces
the rotary embedding with one node fewer than 2.13, which moves every hunk by a line and renames a `sub`).
Node and size symbol names are normalized by fxfuse.rewrite.graph_diff, but the ops themselves come from
torch's decompositions and can change with the torch version. After checking that a difference is
expected, regenerate it with:

    FXFUSE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_report.py -k golden
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from fxfuse.cli import main
from fxfuse.inspect.compiled_report import report_compiled
from fxfuse.inspect.site_report import SiteRow, fake_process_group, report_model, summarize, trace_model, trace_sites
from fxfuse.models.layers import RMSNorm
from fxfuse.models.parallel import ParallelContext
from fxfuse.models.presets import get_preset
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, MERGE_ALLREDUCE

GOLDEN = Path(__file__).parent / "golden" / "tiny_tp2.diff"
TINY_BLOCKS = [(None, "embedding")] + [(0, "attention"), (0, "MLP")] + [(i, b) for i in (1, 2, 3) for b in ("attention", "MoE")]


@pytest.fixture(scope="module")
def tiny_trace():
    """The tiny preset traced at tp=2 (bfloat16): (backend, compile seconds)."""
    return trace_model(get_preset("tiny"), 2)


@pytest.mark.slow
def test_tiny_report_rows(tiny_trace):
    report = summarize(*tiny_trace, model="tiny", layers=4, tp=2, dtype=torch.bfloat16)
    assert (report.allreduce_sites, report.fused_sites, report.fused_ops, report.merged) == (9, 9, 9, 0)
    assert [(row.layer, row.block) for row in report.sites] == TINY_BLOCKS
    assert all(row.fused and not row.merged and row.reason is None for row in report.sites)
    assert [row.module for row in report.sites[:3]] == [
        "model.embed_tokens", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"
    ]
    assert report.trace_seconds > 0 and report.pass_seconds > 0
    document = json.loads(json.dumps(report.to_json()))
    assert document["allreduce_sites"] == document["fused_sites"] == len(document["sites"]) == 9
    assert document["sites"][4] == {"index": 4, "layer": 1, "block": "MoE", "module": "model.layers.1.mlp",
                                     "fused": True, "merged": False, "reason": None, "graph": 0,
                                     "collective": "all_reduce", "fp8": None, "tier": "a"}
    assert report.table().splitlines()[-1].startswith("tiny (4 layers, tp=2, bfloat16): 9 of 9 all-reduce sites fused")


@pytest.mark.slow
def test_golden_diff(tiny_trace):
    """The tiny model's before/after diff is exactly tests/golden/tiny_tp2.diff (see the module docstring)."""
    backend, _ = tiny_trace
    diff = backend.records[-1].diff()
    if os.environ.get("FXFUSE_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(diff)
    assert _changes(diff) == _changes(GOLDEN.read_text())


def _changes(diff: str) -> list[str]:
    """The op count table and the removed and added lines of a diff, hunk by hunk (context left out)."""
    return [("@@" if line.startswith("@@") else line) for line in diff.splitlines() if not line.startswith(" ")]


@pytest.mark.slow
def test_disabled_pattern_is_the_reason():
    """With pattern 2 off, the embedding site stays unfused and says so; the layer's sites still fuse."""
    report = report_model(get_preset("tiny", layers=1), 2, name="tiny", patterns=(MERGE_ALLREDUCE, ALLREDUCE_RESIDUAL_RMSNORM))
    assert [(row.block, row.fused, row.reason) for row in report.sites] == [
        ("embedding", False, "pattern allreduce_rmsnorm is disabled"),
        ("attention", True, None),
        ("MLP", True, None),
    ]
    assert (report.allreduce_sites, report.fused_sites) == (3, 2)


class PartialLinear(nn.Module):
    """A row-parallel projection: this rank's partial sum, for the caller to all-reduce."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ToyAttention(PartialLinear):
    """Stands in for an attention block's output projection."""


class ToyMLP(PartialLinear):
    """Stands in for an MLP block's down projection."""


class ToyLayer(nn.Module):
    """Attention into an RMSNorm (fusible), then an MLP whose sum feeds a LayerNorm (not fusible)."""

    def __init__(self, ctx, dim: int = 16, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.ctx = ctx
        self.self_attn, self.mlp = ToyAttention(dim, dtype), ToyMLP(dim, dtype)
        self.post_attention_layernorm = RMSNorm(dim, 1e-6, dtype=dtype)
        self.final_layernorm = nn.LayerNorm(dim, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.ctx.all_reduce(self.self_attn(hidden))
        hidden = hidden + self.ctx.all_reduce(self.mlp(self.post_attention_layernorm(hidden)))
        return self.final_layernorm(hidden)


class ToyOfficialMoE(nn.Module):
    """DeepSeek's official MoE: routed and shared experts each all-reduce their own partial sum."""

    def __init__(self, ctx, dim: int = 16, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.ctx = ctx
        self.experts, self.shared_experts = PartialLinear(dim, dtype), ToyMLP(dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(self.experts(x)) + self.ctx.all_reduce(self.shared_experts(x))


class ToyMoELayer(nn.Module):
    """The official MoE block, its sum added to the residual and normed (merge, then fuse)."""

    def __init__(self, ctx, dim: int = 16, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.mlp = ToyOfficialMoE(ctx, dim, dtype)
        self.norm = RMSNorm(dim, 1e-6, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden + self.mlp(hidden))


class ToyModel(nn.Module):
    """One layer of `layer_type` in `layers`, so sites get a layer index."""

    def __init__(self, ctx, layer_type: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer_type(ctx)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[0](hidden)


def toy_inputs() -> tuple[torch.Tensor]:
    return (torch.empty(3, 16, dtype=torch.bfloat16),)


def test_site_without_rmsnorm_says_why():
    backend, _ = trace_sites(lambda ctx: ToyModel(ctx, ToyLayer), toy_inputs, tp=2)
    assert backend.sites == [
        SiteRow(0, 0, "attention", "layers.0.self_attn", True, False, None),
        SiteRow(1, 0, "MLP", "layers.0.mlp", False, False, "no RMSNorm follows the all-reduce or its residual add"),
    ]


def test_merged_sites_are_fused_and_marked():
    """Two all-reduces of one MoE block are merged into one, which is then fused: both rows say so."""
    backend, seconds = trace_sites(lambda ctx: ToyModel(ctx, ToyMoELayer), toy_inputs, tp=2)
    assert backend.sites == [
        SiteRow(0, 0, "MoE", "layers.0.mlp.experts", True, True, None),
        SiteRow(1, 0, "MoE", "layers.0.mlp.shared_experts", True, True, None),
    ]
    report = summarize(backend, seconds, model="toy", layers=1, tp=2, dtype=torch.bfloat16)
    assert (report.allreduce_sites, report.fused_sites, report.fused_ops, report.merged) == (2, 2, 1, 1)


@pytest.fixture(scope="module")
def deepseek_v3_tp8():
    """DeepSeek-V3 at its real widths and all 61 layers, reported at tp=8: one trace (minutes on 2 cores)
    that this preset's tp=8 tests share."""
    return report_model(get_preset("deepseek-v3"), 8, name="deepseek-v3")


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
@pytest.mark.slow
def test_full_width_presets_at_tp8(preset, request):
    """The real widths at tp=8 (dense and MoE layers of both presets): all fused. Kimi-K2 is cut to 4
    layers; DeepSeek-V3 reads the full-depth trace (`deepseek_v3_tp8`) instead of tracing a 4-layer cut
    too: layers are built from their index alone, so its first 4 are the cut's, and its last layer's sum
    goes into the final norm as the cut's layer 3 does."""
    if preset == "deepseek-v3":
        report = request.getfixturevalue("deepseek_v3_tp8")
    else:
        report = report_model(get_preset(preset, layers=4), 8, name=preset)
    sites = 1 + 2 * report.layers  # the embedding, then attention and MLP/MoE per layer
    assert report.allreduce_sites == report.fused_sites == report.fused_ops == sites
    assert {row.block for row in report.sites} == {"embedding", "attention", "MLP", "MoE"}


@pytest.mark.slow
def test_cli_report_from_checkpoint_config(tmp_path, capsys):
    """`fxfuse report --checkpoint DIR` needs only config.json; --json writes the rows and timings."""
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    out = tmp_path / "report.json"
    assert main(["report", "--checkpoint", str(tmp_path), "--layers", "1", "--tp", "2", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert (document["allreduce_sites"], document["fused_sites"], document["layers"], document["tp"]) == (3, 3, 1, 2)
    assert [site["block"] for site in document["sites"]] == ["embedding", "attention", "MLP"]
    assert document["trace_seconds"] > 0 and document["pass_seconds"] > 0
    assert "3 of 3 all-reduce sites fused" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_report_of_fp8_weights_names_each_folded_quantization_and_the_search_cost(tmp_path, capsys, monkeypatch):
    """`FXFUSE_FP8_GEMM=w8a8 fxfuse report --weights fp8`: each GEMM after a norm quantizes its input, the report
    names the recipe folded at each site and the FP8 searches' share of the pass time (one search, the sites share
    its structure)."""
    monkeypatch.setenv("FXFUSE_FP8_GEMM", "w8a8")
    out = tmp_path / "report.json"
    argv = ["report", "--preset", "deepseek-v3", "--tp", "8", "--layers", "2", "--weights", "fp8", "--json", str(out)]
    assert main(argv) == 0
    document = json.loads(out.read_text())
    folded = [site["fp8"] for site in document["sites"]]
    # The model's bound 1e-12 is a module constant: torch 2.15's dynamo passes it in as a graph input under the
    # report's dynamic shapes, and the op then reads it when it runs, which the report says
    assert folded[0] in ("fused: per_group 128, max >= 1e-12", "fused: per_group 128, max >= a value of the graph")
    assert folded == [folded[0]] * 4 + [None]  # the final norm feeds the bf16 lm_head
    assert document["fp8_quantizations"] == 4 and document["fp8_searches"] in (0, 1)  # 0: kept from an earlier search
    assert 0 <= document["fp8_search_seconds"] <= document["pass_seconds"]
    assert "quantizations)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "tiny-llama"], "unknown model preset 'tiny-llama'"),
        (["--tp", "3"], "tensor parallel size 3 does not divide"),
        (["--checkpoint", "/nonexistent"], "has no config.json"),
        (["--weights", "int4"], "argument --weights: invalid choice: 'int4'"),
        (["--weights", "fp8"], "cannot keep FP8 weights split by num_attention_heads at tensor-parallel size 2"),
    ],
    ids=["preset", "tp", "checkpoint", "weights", "fp8_tiny"],
)
def test_cli_report_rejects_bad_input(argv, message, capsys):
    assert main(["report", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_deepseek_v3_tp8_full_depth(deepseek_v3_tp8):
    """All 61 layers at tp=8: 122 layer sites + the embedding, every one fused (minutes on 2 cores)."""
    report = deepseek_v3_tp8
    assert report.allreduce_sites == report.fused_sites == report.fused_ops == 123
    assert [row.layer for row in report.sites[1:]] == [i for i in range(61) for _ in range(2)]


# ---------------------------------------------------------------- report_compiled: any function or module


class ToyBlock(nn.Module):
    """A pre-norm decoder block with row-parallel attention and MLP outputs (all-reduced)."""

    def __init__(self, ctx, dim: int = 16, dtype: torch.dtype = torch.float32, grad: bool = False) -> None:
        super().__init__()
        self.ctx = ctx
        self.input_layernorm = RMSNorm(dim, 1e-6, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(dim, 1e-6, dtype=dtype)
        self.self_attn, self.mlp = ToyAttention(dim, dtype), ToyMLP(dim, dtype)
        for p in self.parameters():
            p.requires_grad_(grad)
            nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.ctx.all_reduce(self.self_attn(self.input_layernorm(hidden)))
        return hidden + self.ctx.all_reduce(self.mlp(self.post_attention_layernorm(hidden)))


class ToyStack(nn.Module):
    """Blocks, then the final norm."""

    def __init__(self, ctx, layers: int = 2, grad: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ToyBlock(ctx, grad=grad) for _ in range(layers)])
        self.norm = RMSNorm(16, 1e-6, dtype=torch.float32)
        nn.init.normal_(self.norm.weight, 1.0, 0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


def test_report_compiled_whole_stack_fuses_every_site():
    with fake_process_group(2) as group, torch.no_grad():
        report = report_compiled(ToyStack(ParallelContext.from_group(group)), torch.randn(3, 16), fullgraph=True)
    assert (report.allreduce_sites, report.fused_sites, report.fused_ops, report.tp, report.layers) == (4, 4, 4, 2, 2)
    assert [(row.layer, row.block, row.fused, row.graph) for row in report.sites] == [
        (0, "attention", True, 0), (0, "MLP", True, 0), (1, "attention", True, 0), (1, "MLP", True, 0)]
    assert report.model == "ToyStack" and report.dtype == "float32"


def test_report_compiled_of_code_without_decoder_layers_counts_none():
    """Issue 41: a plain block (no decoder-layer index in its module names) used to be reported as "0 layers"."""
    from toy_graphs import decoder_inputs, toy_decoder, RMSNORMS

    with fake_process_group(2) as group, torch.no_grad():
        report = report_compiled(lambda *a: toy_decoder(*a, group=group, norm=RMSNORMS["transformers"]),
                                 *decoder_inputs(torch.float32), name="toy_decoder", fullgraph=True)
    assert report.layers is None and report.to_json()["layers"] is None
    assert report.table().splitlines()[-1].startswith("toy_decoder (tp=2, float32): 4 of 4 all-reduce sites fused")


def test_report_compiled_with_grad_enabled_says_why():
    """With grad enabled the forward graph saves the norms' intermediates for backward: nothing fuses,
    and every row says so, naming the saved node."""
    with fake_process_group(2) as group:
        report = report_compiled(ToyStack(ParallelContext.from_group(group), grad=True), torch.randn(3, 16),
                                 fullgraph=True)
    assert (report.allreduce_sites, report.fused_sites) == (4, 0)
    for row in report.sites:
        assert re.fullmatch(r"`\w+` \(\w+\) inside the all-reduce -> RMSNorm chain is saved for backward \(grad is "
                            r"enabled\): compile under torch\.no_grad\(\) or torch\.inference_mode\(\)", row.reason), row


def test_report_compiled_one_graph_per_block_says_the_norm_is_in_another_graph():
    """torchtitan compiles one block at a time: the MLP's sum ends that graph and its norm begins the next
    (here the same graph run again). The report says so; the whole stack in one graph fuses it."""
    with fake_process_group(2) as group, torch.no_grad():
        block_report = report_compiled(ToyStack(ParallelContext.from_group(group)).layers[0], torch.randn(3, 16),
                                       fullgraph=True)
    assert [(row.block, row.fused) for row in block_report.sites] == [("attention", True), ("MLP", False)]
    assert re.fullmatch(
        r"`\w+` \(the all-reduced value plus residual\) is returned from the graph and no RMSNorm follows it here "
        r"\(the function was compiled with fullgraph=True\): "
        r"graph 0 applies an RMSNorm to its input `\w+`, so the norm is in another graph \(or a later run of this "
        r"one, as with torch\.compile on each decoder block\): compile the whole stack as one graph",
        block_report.sites[1].reason)


def test_report_compiled_rows_of_every_graph():
    """A graph break between two blocks makes two graphs: rows of both, the first graph's MLP sum pointing at
    the second graph, whose first norm reads it."""
    with fake_process_group(2) as group, torch.no_grad():
        stack = ToyStack(ParallelContext.from_group(group))

        def broken_stack(hidden):
            hidden = stack.layers[0](hidden)
            torch._dynamo.graph_break()
            return stack.norm(stack.layers[1](hidden))

        report = report_compiled(broken_stack, torch.randn(3, 16))
    assert [(row.graph, row.index, row.block, row.fused) for row in report.sites] == [
        (0, 0, "attention", True), (0, 1, "MLP", False), (1, 0, "attention", True), (1, 1, "MLP", True)]
    assert "graph 1 applies an RMSNorm to its input" in report.sites[1].reason
    assert (report.allreduce_sites, report.fused_sites, report.fused_ops) == (4, 3, 3)
    assert "1:1" in report.table()


def test_report_compiled_lists_reduce_scatter_sites():
    def sequence_parallel_site(x, res, w):
        h = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) + res
        return F.rms_norm(h, (16,), w, 1e-6), h

    with fake_process_group(2), torch.no_grad():
        report = report_compiled(sequence_parallel_site, torch.randn(8, 16), torch.randn(4, 16), torch.randn(16),
                                 fullgraph=True)
    (row,) = report.sites
    assert (row.collective, row.fused, report.allreduce_sites) == ("reduce_scatter", False, 0)
    assert row.reason.startswith("`reduce_scatter_tensor` is a reduce-scatter (sequence parallel), not an all-reduce")


@pytest.mark.slow
@pytest.mark.parametrize("fusion, says", [("off", "FXFUSE_FUSION=off: every fused site runs the NCCL all-reduce"),
                                          ("auto", "fused sites run what the ranks agree on at the first call")])
def test_the_report_says_what_fused_sites_run_under_the_settings(monkeypatch, fusion, says):
    """`FXFUSE_FUSION=off fxfuse report` said the sites were fused and nothing else, while the run sent
    every one of them through NCCL: the report now says what the setting makes them run."""
    from fxfuse.op.decide.settings import current_settings

    monkeypatch.setenv("FXFUSE_FUSION", fusion)
    current_settings.cache_clear()
    try:
        report = report_model(get_preset("tiny", layers=1), 2, name="tiny")
    finally:
        current_settings.cache_clear()
    assert report.runtime.startswith(says) and report.table().splitlines()[-2] == report.runtime
    assert report.to_json()["runtime"] == report.runtime
