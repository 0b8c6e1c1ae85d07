"""Threads per rank from the cores this process may use (issue 41, item 9): a container's CPU quota or the
affinity mask, not the host's CPU count (`fxfuse run --tp 1` on a 2-core slice ran 60x slower with as many
threads as the host has CPUs)."""

from __future__ import annotations

import os

from fxfuse.runner.cores import available_cores, threads_per_rank


def test_a_cgroup_v2_quota_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert available_cores(tmp_path) == 2 and threads_per_rank(1, tmp_path) == 2 and threads_per_rank(2, tmp_path) == 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: rounded up
    assert available_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no quota: the affinity mask
    assert available_cores(tmp_path) == 64 and threads_per_rank(8, tmp_path) == 8


def test_a_cgroup_v1_quota_caps_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cores(tmp_path) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert available_cores(tmp_path) == 16


def test_the_affinity_mask_caps_the_cores_and_every_rank_gets_one(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert available_cores(tmp_path) == 1 and threads_per_rank(4, tmp_path) == 1
