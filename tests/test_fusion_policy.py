"""CPU tests of the decision table (every branch: settings, topology, FlashInfer version gates, arch,
world size, dtypes, alignment, launch shape, workspace capacity, thresholds), the thresholds table and
the settings parser."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

from fxfuse.op.decide.flashinfer_version import features, parse_version
from fxfuse.op.decide.modes import FusionMode
from fxfuse.op.decide.policy import (
    FusionDecision,
    FusionProblem,
    decide,
    feasible_trtllm_modes,
    flashinfer_prefers_oneshot,
    kernel_threads_per_block,
    trtllm_token_cap,
)
from fxfuse.op.decide.settings import FusionSettings, settings_from_env
from fxfuse.op.decide.thresholds import (
    DEFAULT_PATH,
    ENV_THRESHOLDS,
    ThresholdEntry,
    ThresholdsError,
    ThresholdTable,
    TokenRange,
    load_thresholds,
    read_table,
    write_table,
)
from fxfuse.op.decide.topology import Topology

H200 = "NVIDIA H200"
AUTO = FusionSettings()
FI_063, FI_0617, FI_072 = features("0.6.3"), features("0.6.18.post1"), features("0.7.2.post1")


def problem(**changes) -> FusionProblem:
    """A fusable problem (H200 NVSwitch, tp=2, bf16, hidden 7168, 32 tokens, 512-token workspaces,
    FlashInfer 0.7.2), changed."""
    base = FusionProblem(
        sm=90, world_size=2, dtype=torch.bfloat16, hidden_size=7168, num_tokens=32,
        weight_dtype=torch.bfloat16, residual_dtype=torch.bfloat16, topology=Topology.NVSWITCH,
        flashinfer=FI_072, trtllm_max_tokens=512, pcie_max_tokens=512,
    )
    return dataclasses.replace(base, **changes)


def entry(ranges, gpu=H200, world_size=2, hidden_size=7168, dtype="bfloat16", topology="any") -> ThresholdEntry:
    return ThresholdEntry(gpu, world_size, hidden_size, dtype,
                          tuple(TokenRange(n, FusionMode(m)) for n, m in ranges), source="test", topology=topology)


# --- the FlashInfer version gates -------------------------------------------------------------

def test_flashinfer_version_gates():
    assert parse_version("0.7.2.post1") == (0, 7, 2) and parse_version("0.6.18rc1") == (0, 6, 18)
    assert (FI_063.trtllm, FI_063.trtllm_sm12, FI_063.pcie) == (True, False, False)
    assert (FI_0617.trtllm, FI_0617.trtllm_sm12, FI_0617.pcie) == (True, True, False)
    assert (FI_072.trtllm, FI_072.trtllm_sm12, FI_072.pcie) == (True, True, True)
    for outside in ("0.6.2", "0.8.0", "1.0", "nonsense"):
        gates = features(outside)
        assert not (gates.trtllm or gates.pcie) and "outside" in gates.why_not
    assert "not installed" in features(None).why_not
    assert FI_063.trtllm_arch_supported(90) and FI_063.trtllm_arch_supported(103)
    assert not FI_063.trtllm_arch_supported(120) and FI_0617.trtllm_arch_supported(120)
    assert not FI_072.trtllm_arch_supported(80)


# --- every fallback branch -------------------------------------------------------------------

@pytest.mark.parametrize(
    "changes, settings, reason_part",
    [
        ({}, FusionSettings(enabled=False), "disabled"),
        ({"num_tokens": 0}, AUTO, "no tokens"),
        ({"world_size": 1}, AUTO, "one-rank group"),
        ({"world_size": 1}, FusionSettings(force_mode=FusionMode.ONESHOT), "world size 1"),
        ({"world_size": 3}, AUTO, "world size 3"),
        ({"world_size": 32}, AUTO, "world size 32"),
        ({"dtype": torch.float32, "weight_dtype": torch.float32, "residual_dtype": torch.float32}, AUTO, "dtype"),
        ({"weight_dtype": torch.float32}, AUTO, "norm weight dtype"),
        ({"residual_dtype": torch.float16}, AUTO, "residual dtype"),
        ({"sm": 80}, AUTO, "sm_80"),
        ({"sm": 120, "flashinfer": FI_063}, AUTO, "needs 0.6.17"),
        ({"hidden_size": 7170}, AUTO, "multiple of 8"),
        ({"hidden_size": 8 * 8 * 1024 + 8}, AUTO, "too large"),
        ({"num_tokens": 513}, AUTO, "do not fit the TensorRT-LLM workspace"),
        ({"trtllm_max_tokens": 0}, AUTO, "do not fit the TensorRT-LLM workspace"),
        ({"flashinfer": features(None)}, AUTO, "not installed"),
        ({"flashinfer": features("0.9.0")}, AUTO, "outside"),
        ({"topology": Topology.NVLINK}, AUTO, "NVLink-bridge"),
        ({"topology": Topology.NONE}, AUTO, "no peer-to-peer"),
        ({"topology": Topology.PCIE, "flashinfer": FI_0617}, AUTO, "older than 0.7.2"),
        ({"topology": Topology.PCIE, "world_size": 16}, AUTO, "not supported by the PCIe all-reduce"),
        ({"topology": Topology.PCIE, "pcie_max_tokens": 16}, AUTO, "do not fit the PCIe workspace"),
        ({"topology": Topology.PCIE, "hidden_size": 7170}, AUTO, "multiple of 8"),
    ],
)
def test_unsupported_problems_fall_back(changes, settings, reason_part):
    decision = decide(problem(**changes), settings)
    assert decision.mode is FusionMode.FALLBACK and not decision.fused
    assert reason_part in decision.reason


def test_topology_picks_the_implementation():
    assert decide(problem(), AUTO).mode is FusionMode.ONESHOT
    pcie = decide(problem(topology=Topology.PCIE), AUTO)
    assert pcie == FusionDecision(FusionMode.PCIE, "PCIe group")
    # SM 12.x PCIe box (RTX PRO 6000): PCIe all-reduce by default, the TensorRT-LLM kernel only when asked
    rtx = problem(sm=120, topology=Topology.PCIE, world_size=8)
    assert decide(rtx, AUTO).mode is FusionMode.PCIE
    assert decide(rtx, FusionSettings(force_mode=FusionMode.ONESHOT)).mode is FusionMode.ONESHOT
    assert decide(dataclasses.replace(rtx, flashinfer=FI_063), FusionSettings(force_mode=FusionMode.ONESHOT)).mode is FusionMode.FALLBACK
    # NVLink bridges (H200 NVL): unfused unless forced or measured
    nvl = problem(topology=Topology.NVLINK)
    assert not decide(nvl, AUTO).fused
    assert decide(nvl, FusionSettings(force_mode=FusionMode.TWOSHOT)).mode is FusionMode.TWOSHOT
    assert decide(nvl, AUTO, entry([(64, "oneshot")], topology="nvlink")).mode is FusionMode.ONESHOT


def test_forced_pcie_runs_wherever_it_can():
    assert decide(problem(), FusionSettings(force_mode=FusionMode.PCIE)).mode is FusionMode.PCIE
    no_pcie = decide(problem(flashinfer=FI_063), FusionSettings(force_mode=FusionMode.PCIE))
    assert no_pcie.mode is FusionMode.FALLBACK and "forced by settings, but PCIe all-reduce unavailable" in no_pcie.reason


def test_supported_arches_and_dtypes_fuse():
    for sm in (90, 100, 103):
        assert decide(problem(sm=sm), AUTO).fused
    fp16 = problem(dtype=torch.float16, weight_dtype=torch.float16, residual_dtype=torch.float16)
    assert decide(fp16, AUTO).fused
    assert decide(problem(residual_dtype=None), AUTO).fused  # no residual: fused with a zero residual
    assert decide(problem(sm=120, flashinfer=FI_0617), AUTO).fused


def test_fp16_alignment_uses_its_element_size():
    assert decide(problem(hidden_size=5120), AUTO).fused  # 5120 = 640 accesses of 8 two-byte elements
    assert "multiple of 8" in decide(problem(hidden_size=5124), AUTO).reason


@pytest.mark.parametrize("hidden, threads", [(2048, 128), (4096, 128), (5120, 160), (7168, 224), (8192, 128)])
def test_real_model_widths_launch_whole_warps(hidden, threads):
    assert kernel_threads_per_block(hidden // 8) == threads
    assert decide(problem(hidden_size=hidden), AUTO).fused


@pytest.mark.parametrize("hidden, threads", [(64, 8), (4104, 513), (9216, 144)])
def test_partial_warp_launch_shapes_fall_back(hidden, threads):
    """The kernel's block reduction (FlashInfer <= 0.6.x) is wrong for blocks of partial warps."""
    assert kernel_threads_per_block(hidden // 8) == threads
    decision = decide(problem(hidden_size=hidden), AUTO)
    assert not decision.fused and f"{threads}-thread blocks" in decision.reason


def test_workspace_token_cap_keeps_lamport_offsets_in_32_bits():
    # tp=8, hidden 7168: 8 * 7168 * 2 = 114688 bytes per token; < 1 GiB allows 9362 tokens.
    assert trtllm_token_cap(8, 7168) == 9362
    assert 8 * 9362 * 7168 * 2 * 2 <= 2**31 - 1 < 8 * 9363 * 7168 * 2 * 2
    assert trtllm_token_cap(2, 4096) == (2**31 - 1) // 2 // (2 * 4096 * 2)


# --- one-shot / two-shot without a table: FlashInfer's heuristic ---------------------------

def test_flashinfer_heuristic_boundaries():
    # tp=8, hidden 7168, bf16: 7168*2*8*2 bytes = 0.21875 MiB per token; 42 MiB -> 192 tokens.
    tp8 = dict(world_size=8, trtllm_max_tokens=2048)
    assert flashinfer_prefers_oneshot(problem(num_tokens=192, **tp8))
    assert not flashinfer_prefers_oneshot(problem(num_tokens=193, **tp8))
    heuristic = "NVSwitch group: FlashInfer heuristic"
    assert decide(problem(num_tokens=192, **tp8), AUTO) == FusionDecision(FusionMode.ONESHOT, heuristic)
    assert decide(problem(num_tokens=193, **tp8), AUTO) == FusionDecision(FusionMode.TWOSHOT, heuristic)
    # tp=16 is not in FlashInfer's table: the kernel's 128-token one-shot limit applies.
    tp16 = dict(world_size=16, trtllm_max_tokens=2048)
    assert decide(problem(num_tokens=128, **tp16), AUTO).mode is FusionMode.ONESHOT
    assert decide(problem(num_tokens=129, **tp16), AUTO).mode is FusionMode.TWOSHOT


def test_two_shot_needs_more_tokens_than_ranks():
    assert feasible_trtllm_modes(problem(num_tokens=2)) == (FusionMode.ONESHOT,)
    assert feasible_trtllm_modes(problem(num_tokens=3)) == (FusionMode.ONESHOT, FusionMode.TWOSHOT)
    forced = decide(problem(num_tokens=2), FusionSettings(force_mode=FusionMode.TWOSHOT))
    assert forced.mode is FusionMode.ONESHOT and "cannot run here" in forced.reason
    assert decide(problem(num_tokens=3), FusionSettings(force_mode=FusionMode.TWOSHOT)).mode is FusionMode.TWOSHOT


def test_one_shot_limited_by_lamport_buffer_size():
    # 16 ranks * 2 bytes * 65536 hidden * 1024 tokens = 2 GiB > FlashInfer's one-shot limit.
    big = problem(world_size=16, hidden_size=65536, num_tokens=1024, trtllm_max_tokens=1024)
    assert feasible_trtllm_modes(big) == (FusionMode.TWOSHOT,)
    assert decide(big, FusionSettings(force_mode=FusionMode.ONESHOT)).mode is FusionMode.TWOSHOT


def test_forced_mode_overrides_table():
    table_entry = entry([(1024, "twoshot")])
    decision = decide(problem(), FusionSettings(force_mode=FusionMode.ONESHOT), table_entry)
    assert decision == FusionDecision(FusionMode.ONESHOT, "forced by settings")


# --- thresholds table -------------------------------------------------------------------------

def test_table_entry_ranges_decide():
    table_entry = entry([(16, "oneshot"), (128, "twoshot"), (256, "pcie"), (512, "fallback")])
    modes = {n: decide(problem(num_tokens=n), AUTO, table_entry).mode for n in (1, 16, 17, 128, 129, 256, 257, 512)}
    assert modes == {1: FusionMode.ONESHOT, 16: FusionMode.ONESHOT, 17: FusionMode.TWOSHOT, 128: FusionMode.TWOSHOT,
                     129: FusionMode.PCIE, 256: FusionMode.PCIE, 257: FusionMode.FALLBACK, 512: FusionMode.FALLBACK}
    beyond = entry([(64, "oneshot")])
    decision = decide(problem(num_tokens=65), AUTO, beyond)
    assert decision.mode is FusionMode.FALLBACK and "unfused is faster at 65 tokens" in decision.reason


def test_table_lookup_keys():
    table = ThresholdTable({e.key(): e for e in [entry([(64, "oneshot")]), entry([(8, "oneshot")], hidden_size=4096),
                                                  entry([(4, "pcie")], topology="pcie")]})
    assert table.lookup(H200, 2, 7168, torch.bfloat16, "pcie").ranges[0].mode is FusionMode.PCIE
    assert table.lookup(H200, 2, 7168, torch.bfloat16, "nvswitch").ranges[0].max_tokens == 64  # the "any" entry
    assert table.lookup("nvidia  h200", 2, 7168, torch.bfloat16).ranges[0].max_tokens == 64
    assert table.lookup(H200, 2, 4096, "torch.bfloat16").ranges[0].max_tokens == 8
    assert table.lookup(H200, 4, 7168, torch.bfloat16) is None
    assert table.lookup(H200, 2, 7168, torch.float16) is None
    assert table.lookup("NVIDIA H100 80GB HBM3", 2, 7168, torch.bfloat16) is None


def test_entry_ranges_must_increase():
    with pytest.raises(ValueError, match="strictly increasing"):
        entry([(64, "oneshot"), (64, "twoshot")])
    with pytest.raises(ValueError):
        entry([])


def test_default_table_is_valid_and_empty():
    assert read_table(DEFAULT_PATH).entries == {}


def test_override_file_by_path_and_env(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    e = entry([(32, "oneshot"), (128, "twoshot")])
    write_table(ThresholdTable({e.key(): e}), path, "test")
    assert json.loads(path.read_text())["entries"][0]["ranges"][1] == {"max_tokens": 128, "mode": "twoshot"}

    by_path = load_thresholds(path, environ={})
    assert by_path.lookup(H200, 2, 7168, torch.bfloat16) == e
    monkeypatch.setenv(ENV_THRESHOLDS, str(path))
    assert load_thresholds(environ=os.environ).lookup(H200, 2, 7168, torch.bfloat16) == e
    assert load_thresholds(environ={}).lookup(H200, 2, 7168, torch.bfloat16) is None


def test_override_replaces_same_key_only():
    old, other = entry([(8, "oneshot")]), entry([(8, "oneshot")], world_size=4)
    new = entry([(99, "twoshot")])
    merged = ThresholdTable({old.key(): old, other.key(): other}).merged(ThresholdTable({new.key(): new}))
    assert merged.lookup(H200, 2, 7168, "bfloat16") == new
    assert merged.lookup(H200, 4, 7168, "bfloat16") == other


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "cannot read thresholds file"),
        ('{"entries": []}', "not a thresholds file"),
        ('{"format": "fxfuse-thresholds/1", "entries": [{"gpu": "x"}]}', "entry 0 is malformed"),
        ('{"format": "fxfuse-thresholds/1", "entries": [{"gpu": "x", "world_size": 2, "hidden_size": 8, '
         '"dtype": "bfloat16", "ranges": [{"max_tokens": 4, "mode": "sometimes"}]}]}', "entry 0 is malformed"),
    ],
)
def test_bad_override_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ThresholdsError, match=message) as info:
        load_thresholds(path, environ={})
    assert "bad.json" in str(info.value)
    with pytest.raises(ThresholdsError, match="cannot read"):
        load_thresholds(tmp_path / "missing.json", environ={})


# --- settings ---------------------------------------------------------------------------------

def test_settings_from_env():
    assert settings_from_env({}) == FusionSettings()
    assert settings_from_env({"FXFUSE_FUSION": "off"}).enabled is False
    assert settings_from_env({"FXFUSE_FUSION": "TwoShot"}).force_mode is FusionMode.TWOSHOT
    assert settings_from_env({"FXFUSE_FUSION": "pcie"}).force_mode is FusionMode.PCIE
    assert settings_from_env({"FXFUSE_MAX_TOKENS": "2048"}).max_tokens == 2048
    assert settings_from_env({"FXFUSE_TOPOLOGY": "PCIe"}).topology is Topology.PCIE
    assert settings_from_env({"FXFUSE_TOPOLOGY": "auto"}).topology is None
    pcie = settings_from_env({"FXFUSE_PCIE_PROFILE": "rootcplx", "FXFUSE_PCIE_TUNE_CACHE": "/t/tune.json"})
    assert (pcie.pcie_profile, pcie.pcie_tune_cache) == ("rootcplx", "/t/tune.json")
    with pytest.raises(ValueError, match="FXFUSE_TOPOLOGY"):
        settings_from_env({"FXFUSE_TOPOLOGY": "infiniband"})
    with pytest.raises(ValueError, match="FXFUSE_PCIE_PROFILE"):
        settings_from_env({"FXFUSE_PCIE_PROFILE": "fast"})
    with pytest.raises(ValueError, match="FXFUSE_FUSION"):
        settings_from_env({"FXFUSE_FUSION": "fast"})
    with pytest.raises(ValueError, match="FXFUSE_MAX_TOKENS"):
        settings_from_env({"FXFUSE_MAX_TOKENS": "0"})
    with pytest.raises(ValueError, match="force_mode"):
        FusionSettings(force_mode=FusionMode.FALLBACK)


@pytest.mark.parametrize("version, runs", [("0.6.3", False), ("0.7.2", True)])
def test_a_weight_offset_needs_flashinfers_weight_bias(version, runs):
    """Gemma's zero-centred norm (`1 + weight` in float32) runs the TensorRT-LLM kernel only where it takes
    `weight_bias` (0.7.2); before, the NCCL path with the fused norm runs it exactly."""
    decision = decide(problem(flashinfer=features(version), weight_offset=1.0), AUTO)
    assert decision.fused is runs
    if not runs:
        assert "offset 1 needs flashinfer 0.7.2" in decision.reason


def test_a_float32_residual_stream_takes_the_pcie_path_not_the_trtllm_one():
    """The PCIe all-reduce is followed by fxfuse's own norm kernel, which adds a float32 residual; the
    TensorRT-LLM kernel cannot."""
    fp32_residual = dict(residual_dtype=torch.float32, weight_dtype=torch.float32)
    assert decide(problem(topology=Topology.PCIE, pcie_max_tokens=512, **fp32_residual), AUTO).mode is FusionMode.PCIE
    nvswitch = decide(problem(**fp32_residual), AUTO)
    assert nvswitch.mode is FusionMode.FALLBACK and "norm weight dtype torch.float32" in nvswitch.reason


# --- ranks agree ------------------------------------------------------------------------------

def test_problem_has_no_per_rank_field():
    fields = {f.name for f in dataclasses.fields(FusionProblem)}
    assert fields == {"sm", "world_size", "dtype", "hidden_size", "num_tokens", "weight_dtype", "residual_dtype",
                      "topology", "flashinfer", "trtllm_max_tokens", "pcie_max_tokens", "weight_offset",
                      "one_kernel_max_tokens"}


def test_decision_depends_only_on_its_arguments(monkeypatch):
    """Two 'ranks' with different rank env, device and RNG state decide identically on a grid."""
    grid = [
        problem(sm=sm, world_size=ws, num_tokens=n, hidden_size=h, trtllm_max_tokens=m, pcie_max_tokens=m,
                one_kernel_max_tokens=m // 8, topology=t)
        for sm in (80, 90, 120) for ws in (1, 2, 8, 16) for n in (0, 1, 3, 9, 193, 4096)
        for h in (4096, 7170) for m in (512, 2048) for t in Topology
    ]
    table_entry = entry([(16, "oneshot"), (32, "pcie_one_kernel"), (64, "pcie"), (600, "twoshot")])
    settings = [AUTO, FusionSettings(force_mode=FusionMode.TWOSHOT), FusionSettings(force_mode=FusionMode.PCIE_ONE_KERNEL),
                FusionSettings(enabled=False)]

    def decisions_as_rank(rank: int):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(rank))
        random.seed(rank)
        torch.manual_seed(rank)
        return [decide(p, s, e) for p in grid for s in settings for e in (None, table_entry)]

    rank0, rank1 = decisions_as_rank(0), decisions_as_rank(1)
    assert rank0 == rank1
    assert {d.mode for d in rank0} == set(FusionMode)  # the grid reaches every branch
