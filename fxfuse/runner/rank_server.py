"""How `fxfuse.runner.launch.run_on_ranks` starts its rank processes: fresh interpreters (multiprocessing's
spawn, the default), or forks of a server process that imported torch's compile stack once (its
forkserver), for a program that launches ranks many times.

A spawned rank imports torch, torch.distributed, Dynamo and Inductor before it runs anything: about 2 s
of one core for torch alone and 4-5 s with the compile stack, per rank and per launch. A program that
launches ranks dozens of times (the test suite) pays that every time. `start_ranks_from_server()` makes
the later launches of this process fork their ranks from one server that imported `preload` once (torch
does not initialize CUDA on import, so the forks may use it).

A fork starts with the server's state, not a fresh interpreter's, so what would differ is handed over or
guarded (multiprocessing itself hands over the working directory and sys.path):
- the environment: a rank replaces its environment with the launcher's before it unpickles its function
  (`adopt_launcher_state`), but what the preloaded modules read from it at import time the server read at
  its start. So a launch whose environment differs from the server's in anything but `REFRESHED_ENV`
  spawns its ranks as before (`environment_drift` names the variables);
- standard output and error: a rank writes to the launcher's current ones, as a spawned rank does (the
  launcher's descriptors 1 and 2 travel with the rank's arguments), not to the server's;
- signals: a forked rank gets the server's dispositions, not the launcher's; `launch._rank_main` sets
  what a rank needs itself (SIGINT ignored);
- exit: a forked rank ends with `os._exit`, which skips the `atexit` handlers a spawned rank's interpreter
  runs as it exits; a forked rank runs them itself (`end_as_a_spawned_rank`), so that whatever they do
  (flush a file, abort) happens as it would;
- the launcher watch: a forked rank's `multiprocessing.parent_process()` is still its launcher (the
  server hands over the launcher's connection), so a rank whose launcher dies still ends.

The choice is per process (multiprocessing keeps one forkserver per process): `rank_start_method()` says
which start method the next launch uses.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from multiprocessing import reduction

#: What the server imports once: everything a compiling rank would import before its first line of work.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing", "torch._dynamo", "torch._inductor.compile_fx")
#: Environment variables a forked rank may see changed from the server's, because nothing preloaded reads
#: them at import time: fxfuse's own settings (prefix `FXFUSE_`; read when used, and fxfuse is not
#: preloaded), the test pytest is running, and those torch's compiler sets for itself while it compiles in
#: the launcher (its cache folders, tool paths, a workspace setting and an address for its C++ wrappers),
#: which it reads again when it compiles.
REFRESHED_ENV_PREFIXES = ("FXFUSE_",)
REFRESHED_ENV = frozenset({
    "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
    "TRITON_LIBDEVICE_PATH", "TORCH_WARM_POOL", "CUBLAS_WORKSPACE_CONFIG", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
})

#: This process's server, as multiprocessing keeps one forkserver per process: "enabled" once
#: `start_ranks_from_server` was called, "environment" once a launch started the server (the environment
#: it started with, less `REFRESHED_ENV`).
_server: dict[str, object] = {}


def start_ranks_from_server(preload: tuple[str, ...] = DEFAULT_PRELOAD) -> None:
    """From now on, start this process's ranks as forks of a server that imported `preload` once (the
    server starts with the next launch, in this process's environment of that moment; once it runs,
    another call changes nothing)."""
    if "environment" not in _server:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    _server["enabled"] = True


def server_enabled() -> bool:
    """Whether this process's launches may fork their ranks from the server (`start_ranks_from_server`)."""
    return "enabled" in _server


def _compared(environment) -> dict[str, str]:
    return {key: value for key, value in environment.items()
            if key not in REFRESHED_ENV and not key.startswith(REFRESHED_ENV_PREFIXES)}


def environment_drift() -> list[str]:
    """The variables in which this process's environment differs from the one the server started with
    (ignoring `REFRESHED_ENV`); [] while no server runs."""
    if "environment" not in _server:
        return []
    now, then = _compared(os.environ), _server["environment"]
    return sorted(key for key in now.keys() | then.keys() if now.get(key) != then.get(key))


def rank_start_method() -> str:
    """"forkserver" where the next launch may fork its ranks from the server (enabled, and this process's
    environment is the server's but for `REFRESHED_ENV`), else "spawn"."""
    if not server_enabled():
        return "spawn"
    if "environment" not in _server:  # the server starts with this launch, in this environment
        _server["environment"] = _compared(os.environ)
        return "forkserver"
    return "spawn" if environment_drift() else "forkserver"


class _LauncherFd:
    """One of the launcher's file descriptors, pickled with a forked rank's arguments: multiprocessing sends
    the descriptor to the rank along with them (`reduction.DupFd`), and the rank unpickles its own copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def launcher_state(start_method: str):
    """What a rank started with `start_method` must take over from this process (pass it to the rank,
    which calls `adopt_launcher_state`): for a forked rank this process's environment and its standard
    output and error; None for a spawned rank, which inherits them."""
    if start_method != "forkserver":
        return None
    streams = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            streams.append(_LauncherFd(fd))
        except OSError:  # closed here: the rank keeps the server's
            streams.append(None)
    return dict(os.environ), streams


def adopt_launcher_state(state) -> None:
    """In a rank, first thing: take over the launcher's environment and standard output and error
    (`launcher_state`; nothing when it is None)."""
    if state is None:
        return
    environment, streams = state
    os.environ.clear()
    os.environ.update(environment)
    for target, fd in zip((1, 2), streams):
        if fd is not None:
            os.dup2(fd, target)
            os.close(fd)


def end_as_a_spawned_rank(state) -> None:
    """In a rank, last thing: a forked one (`state` not None) runs the `atexit` handlers, as a spawned rank's
    interpreter does when it exits (multiprocessing ends a forked one with `os._exit`)."""
    if state is not None:
        atexit._run_exitfuncs()
