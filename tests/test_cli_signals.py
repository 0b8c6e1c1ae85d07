"""Stopping `fxfuse run` from outside: Ctrl-C ends it with exit status 130 and SIGTERM with 143, each with
one `fxfuse: error:` line and no traceback or warning after it, and no rank process outlives it (the
launcher stops them; a rank whose launcher was killed outright exits on its own). A rank killed by SIGKILL
mid-run is named, said to have probably run out of memory, and `fxfuse run` says what to lower."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxfuse.cli import main

#: Seconds a stopped run and its ranks get to end before the test fails (the launcher needs at most
#: about TERMINATE_GRACE_S after the signal).
STOP_DEADLINE_S = 20.0
#: Seconds the run gets to start its ranks (interpreter and torch start-up on a loaded 2-core machine).
START_DEADLINE_S = 180.0


@pytest.mark.parametrize("stop, status, line", [(KeyboardInterrupt, 130, "fxfuse: error: interrupted (Ctrl-C)\n"),
                                                ("terminated", 143, "fxfuse: error: terminated (SIGTERM)\n")])
def test_a_stopped_command_is_one_line_and_its_signal_status(stop, status, line, monkeypatch, capsys):
    import fxfuse.runner.options as options
    from fxfuse.runner.errors import Terminated

    def stopped(*args, **kwargs):
        raise Terminated() if stop == "terminated" else stop()

    monkeypatch.setattr(options, "prepare_run", stopped)
    assert main(["run"]) == status
    assert capsys.readouterr().err == line


def test_the_sigterm_handler_is_restored_after_the_command():
    before = signal.getsignal(signal.SIGTERM)
    assert main(["plan", "--preset", "tiny", "--tp", "2", "--gpu-memory-gb", "80"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _default_sigint() -> None:
    """In the child before exec: SIGINT at its default disposition, as in a terminal's foreground job.
    A test run started in the background (`pytest &` from a script) inherits SIGINT ignored, and a
    Python started with SIGINT ignored keeps ignoring it, as POSIX shells intend for background jobs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run_and_wait_for_ranks(tmp_path: Path, until: str = "building tiny") -> tuple[subprocess.Popen, list[int]]:
    """`python -m fxfuse run` in its own session, with Ctrl-C's default disposition, once rank 0 has printed
    `until` (by default: that it builds the model): the process and its rank processes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fxfuse", "run", "--steps", "64"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    deadline = time.monotonic() + START_DEADLINE_S
    seen = ""
    while until not in seen and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 1.0)[0]:
            seen += proc.stderr.readline()
    if until not in seen:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run did not print {until!r} within {START_DEADLINE_S:.0f} s:\n{seen[-3000:]}")
    ranks = [pid for pid in children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 2, ranks
    return proc, ranks


@pytest.mark.slow
@pytest.mark.parametrize("how, status, line", [("sigterm", 143, "fxfuse: error: terminated (SIGTERM)"),
                                               ("ctrl-c", 130, "fxfuse: error: interrupted (Ctrl-C)")])
def test_stopping_a_run_stops_its_ranks(how, status, line, tmp_path):
    """Stopped while it compiles (the prefill's compile has run torch's FX interpreter, which draws progress
    bars): the promised line is the last one, with no resource-tracker warning of leaked semaphores after it."""
    proc, ranks = start_run_and_wait_for_ranks(tmp_path, until="fxfuse: compiling the verify step")
    try:
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:  # a terminal's Ctrl-C: SIGINT to every process of the foreground group, ranks included
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=STOP_DEADLINE_S)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if running(pid)], "rank processes survived the run"
        assert proc.returncode == status
        assert "leaked semaphore" not in err and "resource_tracker" not in err, err[-3000:]
        assert err.splitlines()[-1] == line and "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance to stop its ranks: each notices and exits by itself."""
    proc, ranks = start_run_and_wait_for_ranks(tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=STOP_DEADLINE_S)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if running(pid)], "rank processes outlived their killed launcher"
    finally:
        for pid in ranks:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def _rank_1_aborts_at_exit(ctx):
    """Returns its rank; rank 1 then aborts while its interpreter exits (as a C++ std::terminate would)."""
    import atexit

    if ctx.rank == 1:
        atexit.register(os.abort)
    return ctx.rank


@pytest.mark.slow
def test_a_rank_that_dies_after_reporting_is_named(capfd):
    """A rank that ends abnormally after its result (a message such as "terminate called without an
    active exception" from a C++ destructor at exit) keeps the results and is named on stderr."""
    from fxfuse.runner.launch import run_on_ranks

    assert run_on_ranks(_rank_1_aborts_at_exit, 2, timeout_s=120) == [0, 1]
    err = capfd.readouterr().err
    assert "fxfuse: rank 1 ended with SIGABRT after reporting its result (the result is complete;" in err
    assert "rank 0 ended" not in err


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_and_the_run_ends(tmp_path):
    """SIGKILL to one rank in the middle of `fxfuse run` (its peer then waits in a collective): the run
    ends within a bounded time with one line naming the rank and the signal, and no rank survives."""
    proc, ranks = start_run_and_wait_for_ranks(tmp_path)
    try:
        os.kill(ranks[1], signal.SIGKILL)
        start = time.monotonic()
        _, err = proc.communicate(timeout=STOP_DEADLINE_S)
        assert time.monotonic() - start < STOP_DEADLINE_S
        deadline = time.monotonic() + STOP_DEADLINE_S
        while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if running(pid)], "rank processes survived the run"
        assert proc.returncode == 1
        last = err.splitlines()[-1]
        assert last.startswith("fxfuse: error: rank ") and "(SIGKILL) ended without reporting a result" in last, err[-3000:]
        assert "most likely the kernel's out-of-memory killer" in last and "a smaller --batch, fewer --layers" in last
        assert "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_rank_killed_for_memory_is_told_what_to_lower(monkeypatch, capsys):
    """A rank that died by SIGKILL without reporting (what the out-of-memory killer does) is said to have
    probably run out of memory, and `fxfuse run` names the options that need less; other failures are not."""
    import fxfuse.runner.run
    from fxfuse.cli import RUN_MEMORY_ADVICE
    from fxfuse.runner.errors import RankFailed
    from fxfuse.runner.launch import OOM_KILLED

    error = f"rank 1 (SIGKILL) ended without reporting a result{OOM_KILLED}"
    failures = iter([RankFailed(error, 1, error, killed_for_memory=True), RankFailed("boom", 0, "ValueError: boom")])

    def failed(setup):
        raise next(failures)

    monkeypatch.setattr(fxfuse.runner.run, "run_prepared", failed)
    assert main(["run"]) == 1
    assert capsys.readouterr().err == f"fxfuse: error: rank 1 failed: {error}; {RUN_MEMORY_ADVICE}\n"
    assert main(["run"]) == 1
    assert capsys.readouterr().err == "fxfuse: error: rank 0 failed: ValueError: boom\n"
