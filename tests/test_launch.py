"""The launcher's rendezvous: the port the ranks meet on is held by the launcher from the moment it is
chosen, so a concurrent launch (another test worker, another fxfuse run) cannot take it."""

from __future__ import annotations

import socket

import pytest

from fxfuse.runner.launch import rendezvous_store, run_on_ranks


def _rank_and_size(ctx) -> tuple[int, int]:
    return ctx.rank, ctx.world_size


def test_the_rendezvous_port_is_listening_before_any_rank_starts():
    store = rendezvous_store(timeout_s=10)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))


def test_ranks_meet_on_the_launchers_store():
    assert run_on_ranks(_rank_and_size, 2, timeout_s=120) == [(0, 2), (1, 2)]
