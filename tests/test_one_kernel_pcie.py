"""The one-kernel PCIe path on CPU: its kernel under Triton's interpreter, its place in the decision table, its
setting, and its buffers' initialisation (the GPU tests, tests/gpu/test_one_kernel_pcie_gpu.py, run the ranks).

The interpreter runs a launch's programs one after another, so within one process a rank's call can only finish
if its peers' rows are already in its receive buffer: most tests below put them there, as a peer's push would,
and then check what the call pushed to its peers, how it keeps the generations, and its outputs against the
two-kernel path's kernels (float16: the interpreter does no bfloat16 arithmetic). One test runs the ranks as
processes at once, over buffers mapped into each from files, so that they wait for each other as on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fault_fakes import FakeRuntime

from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import ONE_KERNEL_MAX_HIDDEN, FusionProblem, decide
from fxfuse.op.decide.settings import FusionSettings, settings_from_env
from fxfuse.op.decide.thresholds import ThresholdEntry, ThresholdTable, TokenRange
from fxfuse.op.decide.topology import Topology
from fxfuse.op.fp8_recipe import FP8_DTYPE, Fp8Recipe, scale_shape
from fxfuse.op.kernels.add_rmsnorm_fp8_kernel import add_rmsnorm_fp8_into
from fxfuse.op.kernels.one_shot_all_reduce_norm import (
    FLAG_WORDS, Epilogue, Fp8Outputs, PeerBuffers, all_reduce_norm_into, receive_buffer_bytes,
)
from fxfuse.op.reference import add_rmsnorm
from fxfuse.op.runtime.cuda_ipc import SharedBufferError, create_shared_buffers
from fxfuse.runner.launch import run_on_ranks

HIDDEN, CAPACITY = 64, 4
SENTINEL = -1


class SimulatedRank:
    """Rank `rank` of `world_size`: every rank's receive buffer in this process, this rank's flags."""

    def __init__(self, world_size: int, rank: int = 0):
        elements = receive_buffer_bytes(world_size, CAPACITY, HIDDEN) // 2
        self.buffers = [torch.full((elements,), SENTINEL, dtype=torch.int16) for _ in range(world_size)]
        self.peers = PeerBuffers(tuple(self.buffers), torch.zeros(FLAG_WORDS, dtype=torch.int32), rank, CAPACITY, HIDDEN)

    def slot(self, receiver: int, generation: int, sender: int, rows: int) -> torch.Tensor:
        """The rows `sender` pushed (or will push) into `receiver`'s buffer for `generation`, as 16-bit patterns."""
        slot = CAPACITY * HIDDEN
        start = (generation * self.peers.world_size + sender) * slot
        return self.buffers[receiver][start:start + rows * HIDDEN].view(rows, HIDDEN)

    def deliver(self, xs: list[torch.Tensor]) -> None:
        """Put every other rank's rows into this rank's buffer for the coming call, as their pushes would."""
        generation = int(self.peers.flags[0])
        for sender, x in enumerate(xs):
            if sender != self.peers.rank:
                self.slot(self.peers.rank, generation, sender, x.shape[0]).copy_(x.view(torch.int16))


def draw(tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, (tokens, HIDDEN), generator=torch.Generator().manual_seed(seed)).half()


def test_a_rank_pushes_its_rows_waits_for_its_peers_and_sums_in_rank_order():
    rank = SimulatedRank(world_size=2, rank=0)
    weight = (1 + 0.25 * draw(1, 99)[0]).half()
    for call, tokens in enumerate((3, 1, 4, 2, 2, 1, 4)):
        xs, residual = [draw(tokens, 10 * call + r) for r in range(2)], draw(tokens, 10 * call + 7)
        generation = int(rank.peers.flags[0])
        rank.deliver(xs)
        residual_out, normed = torch.empty_like(residual), torch.empty_like(residual)
        all_reduce_norm_into(rank.peers, xs[0], Epilogue.NORM, residual, weight, 1e-6, residual_out, normed)
        expected_normed, expected_residual = add_rmsnorm((xs[0].float() + xs[1].float()).half(), residual, weight, 1e-6)
        assert torch.equal(residual_out, expected_residual) and torch.equal(normed, expected_normed)
        # its rows went into slot [generation, rank 0] of both buffers, the peer's included
        assert torch.equal(rank.slot(1, generation, 0, tokens), xs[0].view(torch.int16))
        assert torch.equal(rank.slot(0, generation, 0, tokens), xs[0].view(torch.int16))
        # the generation advanced, and the previous generation's rows in its own buffer are empty again
        assert rank.peers.flags.tolist()[:2] == [(generation + 1) % 3, 0] and int(rank.peers.flags[2 + generation]) == tokens
        previous = (generation + 2) % 3
        assert bool((rank.slot(0, previous, 0, CAPACITY) == SENTINEL).all() & (rank.slot(0, previous, 1, CAPACITY) == SENTINEL).all())
        rank.slot(1, generation, 0, CAPACITY).fill_(SENTINEL)  # the peer's own call would clear what it received


def test_an_input_equal_to_the_empty_value_is_sent_as_another_nan_and_the_sum_is_nan():
    rank = SimulatedRank(world_size=2)
    xs = [draw(2, 1), draw(2, 2)]
    xs[0].view(torch.int16)[1, 3] = SENTINEL
    rank.deliver(xs)
    out = torch.empty_like(xs[0])
    all_reduce_norm_into(rank.peers, xs[0], Epilogue.ALL_REDUCE, normed=out)
    assert int(rank.slot(1, 0, 0, 2)[1, 3]) == 0x7FFF  # a NaN that is not the empty value
    assert out[1, 3].isnan() and not out.isnan().sum() > 1
    assert torch.equal(out[0], xs[0][0] + xs[1][0])


def test_the_fp8_epilogue_is_the_two_kernel_paths_at_four_ranks():
    rank = SimulatedRank(world_size=4, rank=2)
    recipe = Fp8Recipe("per_group", 16, 1e-12)
    xs, residual = [draw(3, r) for r in range(4)], draw(3, 9)
    weight = torch.ones(HIDDEN, dtype=torch.float16)
    rank.deliver(xs)
    residual_out, quantized = torch.empty_like(residual), torch.empty(3, HIDDEN, dtype=FP8_DTYPE)
    scales = torch.empty(scale_shape(residual.shape, recipe))
    all_reduce_norm_into(rank.peers, xs[2], Epilogue.FP8, residual, weight, 1e-6, residual_out, None,
                         fp8=Fp8Outputs(recipe, None, quantized, scales))
    reduced = (xs[0].float() + xs[1].float() + xs[2].float() + xs[3].float()).half()
    expected = [torch.empty_like(residual), torch.empty_like(quantized), torch.empty_like(scales)]
    add_rmsnorm_fp8_into(reduced, residual, weight, 1e-6, recipe, None, expected[0], None, expected[1], expected[2])
    assert torch.equal(residual_out, expected[0]) and torch.equal(scales, expected[2])
    assert torch.equal(quantized.view(torch.uint8), expected[1].view(torch.uint8))


def test_a_call_the_workspace_cannot_hold_is_refused_before_it_runs():
    with pytest.raises(ValueError, match="runs 2-8 ranks, not 1"):
        all_reduce_norm_into(SimulatedRank(world_size=1).peers, draw(1, 0), Epilogue.ALL_REDUCE, normed=draw(1, 0))
    rank = SimulatedRank(world_size=2)
    with pytest.raises(ValueError, match="holds 1-4 rows of 64"):
        all_reduce_norm_into(rank.peers, draw(CAPACITY + 1, 0), Epilogue.ALL_REDUCE, normed=draw(CAPACITY + 1, 0))
    with pytest.raises(ValueError, match="holds 1-4 rows of 64"):
        all_reduce_norm_into(rank.peers, torch.zeros(1, 32, dtype=torch.float16), Epilogue.ALL_REDUCE,
                             normed=torch.zeros(1, 32, dtype=torch.float16))
    assert rank.peers.flags.tolist() == [0] * FLAG_WORDS


# ---------------------------------------------------------------- the decision table


def pcie_problem(**changes) -> FusionProblem:
    from fxfuse.op.decide.flashinfer_version import FlashInferFeatures

    base = FusionProblem(sm=120, world_size=8, dtype=torch.bfloat16, hidden_size=7168, num_tokens=8,
                         weight_dtype=torch.bfloat16, residual_dtype=torch.bfloat16, topology=Topology.PCIE,
                         flashinfer=FlashInferFeatures("0.7.2", trtllm=True, trtllm_sm12=True, pcie=True),
                         trtllm_max_tokens=0, pcie_max_tokens=512, one_kernel_max_tokens=256)
    return dataclasses.replace(base, **changes)


FORCED = FusionSettings(force_mode=FusionMode.PCIE_ONE_KERNEL)


def tuned_entry(*ranges) -> ThresholdEntry:
    return ThresholdEntry("NVIDIA RTX PRO 6000", 8, 7168, "bfloat16", tuple(TokenRange(n, FusionMode(m)) for n, m in ranges),
                          "fxfuse tune pcie", "pcie")


def test_without_a_tuning_file_a_pcie_group_keeps_the_two_kernel_path():
    assert decide(pcie_problem(), FusionSettings()).mode is FusionMode.PCIE


def test_a_tuning_files_ranges_choose_the_one_kernel_where_it_was_faster():
    entry = tuned_entry((16, "pcie_one_kernel"), (512, "pcie"))
    assert decide(pcie_problem(num_tokens=16), FusionSettings(), entry).mode is FusionMode.PCIE_ONE_KERNEL
    assert decide(pcie_problem(num_tokens=17), FusionSettings(), entry).mode is FusionMode.PCIE
    table = ThresholdTable.from_json(ThresholdTable({entry.key(): entry}).to_json())
    assert table.lookup("NVIDIA RTX PRO 6000", 8, 7168, torch.bfloat16, "pcie").ranges[0].mode is FusionMode.PCIE_ONE_KERNEL


@pytest.mark.parametrize("changes, why", [
    ({"num_tokens": 257}, "257 tokens do not fit its workspace (256 tokens)"),
    ({"hidden_size": ONE_KERNEL_MAX_HIDDEN + 8}, f"wider than the one-kernel path's {ONE_KERNEL_MAX_HIDDEN}"),
    ({"one_kernel_max_tokens": 0}, "do not fit its workspace (0 tokens)"),  # its workspace could not be made
])
def test_where_the_one_kernel_cannot_run_the_two_kernel_path_does(changes, why):
    decision = decide(pcie_problem(**changes), FORCED)
    assert decision.mode is FusionMode.PCIE and why in decision.reason and "PCIe two-kernel path" in decision.reason


def test_forced_it_needs_no_flashinfer_but_a_world_size_it_runs_at():
    from fxfuse.op.decide.flashinfer_version import FlashInferFeatures

    no_flashinfer = FlashInferFeatures(None, False, False, False, "flashinfer-python is not installed")
    assert decide(pcie_problem(flashinfer=no_flashinfer), FORCED).mode is FusionMode.PCIE_ONE_KERNEL
    decision = decide(pcie_problem(world_size=16, flashinfer=no_flashinfer), FORCED)
    assert decision.mode is FusionMode.FALLBACK and "world size 16 not supported by the one-kernel path" in decision.reason
    assert decide(pcie_problem(dtype=torch.float32, weight_dtype=torch.float32, residual_dtype=torch.float32),
                  FORCED).mode is FusionMode.FALLBACK


def test_the_setting_forces_it():
    assert settings_from_env({"FXFUSE_FUSION": "pcie_one_kernel"}).force_mode is FusionMode.PCIE_ONE_KERNEL
    assert settings_from_env({"FXFUSE_FUSION": "pcie_one_kernel"}).fusion == "pcie_one_kernel"


# ---------------------------------------------------------------- its buffers start empty before any peer maps them


def initialised_buffers(ctx, fail_rank):
    runtime = FakeRuntime(ctx.rank, {"memset": fail_rank} if fail_rank is not None else None)
    try:
        create_shared_buffers([256], ctx.group, runtime, device_index=0, initial_byte=0xFF)
    except SharedBufferError as error:
        return {"error": str(error), "live": len(runtime.live), "mapped": len(runtime.mapped)}
    return {"calls": runtime.calls}


@pytest.mark.slow
def test_each_buffer_is_set_to_empty_before_its_handle_leaves_the_rank():
    for report in run_on_ranks(initialised_buffers, 2, None, timeout_s=120):
        [(memset, pointer, value), synchronize, (export, exported)] = report["calls"]
        assert (memset, value, synchronize[0], export, exported) == ("memset", 0xFF, "synchronize", "ipc_handle", pointer)
    for report in run_on_ranks(initialised_buffers, 2, 1, timeout_s=120):
        assert "rank 1, initializing the shared buffers (cudaMemset)" in report["error"]
        assert (report["live"], report["mapped"]) == (0, 0)


# ---------------------------------------------------------------- the tuner's thresholds entry


def test_the_tuner_gives_each_token_count_the_faster_path_and_the_two_kernel_path_above(tmp_path):
    from fxfuse.bench.compare_pcie_paths import buckets
    from fxfuse.bench.tune_pcie import (
        describe_ranges,
        timings_table,
        tuned_ranges,
        write_thresholds,
    )
    from fxfuse.op.decide.settings import MAX_WORKSPACE_TOKENS
    from fxfuse.op.decide.thresholds import read_table

    assert buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256] and buckets(24) == [1, 2, 4, 8, 16, 24]
    timings = {1: (6.0, 4.0), 2: (6.1, 4.2), 4: (6.3, 6.5), 8: (7.0, 6.0), 16: (8.0, 9.0)}  # (two kernels, one kernel)
    ranges = [(r.max_tokens, r.mode.value) for r in tuned_ranges(timings)]
    assert ranges == [(2, "pcie_one_kernel"), (4, "pcie"), (8, "pcie_one_kernel"), (MAX_WORKSPACE_TOKENS, "pcie")]
    assert [r.mode.value for r in tuned_ranges({1: (5.0, 6.0)})] == ["pcie"]  # never faster: as without the file
    path = tmp_path / "thresholds.json"
    first = write_thresholds(str(path), "NVIDIA RTX PRO 6000", 8, 7168, "bfloat16", timings)
    write_thresholds(str(path), "NVIDIA RTX PRO 6000", 8, 4096, "bfloat16", {1: (5.0, 6.0)})  # merged, not replaced
    table = read_table(path)
    assert table.lookup("NVIDIA RTX PRO 6000", 8, 7168, "bfloat16", "pcie") == first
    assert table.lookup("NVIDIA RTX PRO 6000", 8, 4096, "bfloat16", "pcie").ranges[0].mode is FusionMode.PCIE
    assert describe_ranges(first).startswith("1-2 tokens: pcie_one_kernel; 3-4 tokens: pcie; 5-8 tokens: pcie_one_kernel")
    assert "| 4 | 6.3 | 6.5 | 1.03 |" in timings_table(timings)
    from fxfuse.op.decide.settings import FusionSettings, what_fused_sites_run

    assert ("the thresholds file chooses fxfuse's one-kernel PCIe path for NVIDIA RTX PRO 6000 x8, hidden 7168 bfloat16: "
            "1-2, 5-8 tokens") in what_fused_sites_run(FusionSettings(), table)


def test_the_tuners_thresholds_file_needs_the_one_kernel_timing(capsys):
    from fxfuse.bench.tune_pcie import main

    assert main(["--thresholds-out", "t.json"]) == 2
    assert "--thresholds-out is where --one-kernel writes its timings" in capsys.readouterr().err


# ---------------------------------------------------------------- ranks in processes, concurrently


CALLS = (3, 1, 4, 2, 4, 1, 1, 3, 2, 4, 4, 1, 2, 3, 1)  # token counts: smaller after larger, so clearing matters


def concurrent_rank(ctx, folder: str, programs: int) -> dict:
    """One rank of processes that share every receive buffer through files mapped into each (the interpreter reads
    them live, so a rank waits for its peers' pushes as on a GPU): CALLS in order, each checked exactly."""
    elements = receive_buffer_bytes(ctx.world_size, CAPACITY, HIDDEN) // 2
    buffers = tuple(torch.from_file(f"{folder}/buffer{r}", shared=True, size=elements, dtype=torch.int16)
                    for r in range(ctx.world_size))
    peers = PeerBuffers(buffers, torch.zeros(FLAG_WORDS, dtype=torch.int32), ctx.rank, CAPACITY, HIDDEN)
    weight = (1 + 0.25 * draw(1, 99)[0]).half()
    recipe = Fp8Recipe("per_row", 0, 1e-12)
    mismatches = []
    for call, tokens in enumerate(CALLS):
        xs, residual = [draw(tokens, 100 * call + r) for r in range(ctx.world_size)], draw(tokens, 100 * call + 99)
        reduced = xs[0].float()
        for x in xs[1:]:
            reduced = reduced + x.float()
        reduced = reduced.half()
        if call % 5 == 4:  # the FP8 epilogue
            quantized, scales = torch.empty(tokens, HIDDEN, dtype=FP8_DTYPE), torch.empty(tokens, 1)
            residual_out = torch.empty_like(residual)
            all_reduce_norm_into(peers, xs[ctx.rank], Epilogue.FP8, residual, weight, 1e-6, residual_out, None,
                                 fp8=Fp8Outputs(recipe, None, quantized, scales), programs=programs)
            expected = [torch.empty_like(residual), torch.empty_like(quantized), torch.empty_like(scales)]
            add_rmsnorm_fp8_into(reduced, residual, weight, 1e-6, recipe, None, expected[0], None, expected[1], expected[2])
            same = (torch.equal(residual_out, expected[0]) and torch.equal(scales, expected[2])
                    and torch.equal(quantized.view(torch.uint8), expected[1].view(torch.uint8)))
        elif call % 5 == 2:  # the all-reduce alone
            out = torch.empty_like(reduced)
            all_reduce_norm_into(peers, xs[ctx.rank], Epilogue.ALL_REDUCE, normed=out, programs=programs)
            same = torch.equal(out, reduced)
        else:
            residual_out, normed = torch.empty_like(residual), torch.empty_like(residual)
            all_reduce_norm_into(peers, xs[ctx.rank], Epilogue.NORM, residual, weight, 1e-6, residual_out, normed,
                                 programs=programs)
            expected_normed, expected_residual = add_rmsnorm(reduced, residual, weight, 1e-6)
            same = torch.equal(residual_out, expected_residual) and torch.equal(normed, expected_normed)
        if not same:
            mismatches.append((call, tokens))
    ctx_barrier = torch.zeros(1)
    torch.distributed.all_reduce(ctx_barrier, group=ctx.group)  # every rank done before the buffers are read
    generation = int(peers.flags[0])
    filled = [int((b.view(3, ctx.world_size, CAPACITY, HIDDEN)[g] != SENTINEL).sum()) for b in buffers[ctx.rank:ctx.rank + 1]
              for g in range(3)]
    return {"mismatches": mismatches, "flags": peers.flags.tolist(), "generation": generation, "filled": filled}


@pytest.mark.slow
@pytest.mark.parametrize("world_size, programs", [(2, 1), (4, 2)])
def test_ranks_in_processes_run_the_protocol_concurrently(tmp_path, world_size, programs):
    elements = receive_buffer_bytes(world_size, CAPACITY, HIDDEN) // 2
    for r in range(world_size):
        (tmp_path / f"buffer{r}").write_bytes(b"\xff" * (2 * elements))  # the empty value, before any rank maps it
    reports = run_on_ranks(concurrent_rank, world_size, str(tmp_path), programs, timeout_s=300)
    last = len(CALLS) % 3 - 1
    for report in reports:
        assert report["mismatches"] == []
        assert report["generation"] == len(CALLS) % 3 and report["flags"][1] == 0
        # only the last call's rows are left in a rank's buffer: every earlier generation was cleared
        assert report["filled"] == [world_size * CALLS[-1] * HIDDEN if g == last % 3 else 0 for g in range(3)]
