"""Ranks forked from the rank server (`fxfuse.runner.rank_server`, which tests/conftest.py enables on CPU
machines): they run the call as spawned ranks do, with the launcher's environment and standard streams of
the moment, ignoring Ctrl-C and receiving tensor arguments; a launch whose environment differs from the
server's in what the preloaded modules may read spawns its ranks instead."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from fxfuse.runner import rank_server
from fxfuse.runner.launch import run_on_ranks

pytestmark = pytest.mark.skipif(not rank_server.server_enabled(),
                                reason="the rank server is enabled by tests/conftest.py on machines without CUDA")


def _what_the_rank_sees(ctx, values: torch.Tensor, variable: str) -> dict:
    print(f"rank {ctx.rank} writes to stdout")
    print(f"rank {ctx.rank} writes to stderr", file=sys.stderr)
    return {"parent": os.getppid(), "variable": os.environ.get(variable), "doubled": values * 2 + ctx.rank,
            "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}


def test_forked_ranks_take_the_launchers_environment_and_streams_and_ignore_ctrl_c(monkeypatch, capfd):
    run_on_ranks(_what_the_rank_sees, 2, torch.zeros(1), "FXFUSE_UNSET", timeout_s=120)  # the server runs by now
    monkeypatch.setenv("FXFUSE_RANK_SERVER_PROBE", "set after the server started")
    assert rank_server.rank_start_method() == "forkserver", rank_server.environment_drift()
    capfd.readouterr()
    values = torch.arange(6.0).view(2, 3)
    ranks = run_on_ranks(_what_the_rank_sees, 2, values, "FXFUSE_RANK_SERVER_PROBE", timeout_s=120)
    captured = capfd.readouterr()
    for rank, seen in enumerate(ranks):
        assert seen["parent"] != os.getpid()  # forked by the server, not by this process
        assert seen["variable"] == "set after the server started"
        assert seen["sigint_ignored"]
        assert torch.equal(seen["doubled"], values * 2 + rank)
        assert f"rank {rank} writes to stdout" in captured.out and f"rank {rank} writes to stderr" in captured.err


def test_a_launch_in_another_environment_spawns_its_ranks(monkeypatch, capfd):
    run_on_ranks(_what_the_rank_sees, 2, torch.zeros(1), "FXFUSE_UNSET", timeout_s=120)
    monkeypatch.setenv("TORCHINDUCTOR_RANK_SERVER_PROBE", "read at import by what the server preloaded")
    assert rank_server.rank_start_method() == "spawn"
    assert rank_server.environment_drift() == ["TORCHINDUCTOR_RANK_SERVER_PROBE"]
    capfd.readouterr()
    ranks = run_on_ranks(_what_the_rank_sees, 2, torch.ones(2), "TORCHINDUCTOR_RANK_SERVER_PROBE", timeout_s=120)
    captured = capfd.readouterr()
    for rank, seen in enumerate(ranks):
        assert seen["parent"] == os.getpid()
        assert seen["variable"] == "read at import by what the server preloaded"
        assert seen["sigint_ignored"]
        assert f"rank {rank} writes to stderr" in captured.err


def test_the_start_method_follows_the_environment_the_server_started_with(monkeypatch):
    monkeypatch.setattr(rank_server, "_server", {})
    assert rank_server.rank_start_method() == "spawn"  # not enabled
    assert rank_server.launcher_state("spawn") is None
    monkeypatch.setattr(rank_server, "_server", {"enabled": True})
    monkeypatch.setenv("FXFUSE_X", "1")
    assert rank_server.rank_start_method() == "forkserver"  # the server starts with this launch
    monkeypatch.setenv("FXFUSE_X", "2")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # Inductor sets it while compiling here
    assert rank_server.rank_start_method() == "forkserver"
    monkeypatch.setenv("RANK_SERVER_PROBE", "anything else may be read at import")
    assert rank_server.rank_start_method() == "spawn"
    assert rank_server.environment_drift() == ["RANK_SERVER_PROBE"]
    monkeypatch.delenv("RANK_SERVER_PROBE")
    assert rank_server.rank_start_method() == "forkserver"
