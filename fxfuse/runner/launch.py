"""Run one function on N tensor-parallel ranks: spawned CPU/GPU processes, or under torchrun.

`run_on_ranks(fn, world_size, ...)` starts `world_size` processes, initializes a process group in
each (gloo on CPU, NCCL on CUDA), calls `fn(ctx, *args)` with that rank's `ParallelContext`, and
returns every rank's result in rank order. A rank that raises makes the whole call raise with that
rank's traceback, and the other ranks are stopped, so a failure never turns into a hang; so does a
rank that has not finished `timeout_s` seconds after the start (the error names the ranks that hung),
and a rank that dies without reporting (named with its exit status or signal; one killed by SIGKILL is
said to have probably run out of memory: that is the out-of-memory killer's signal).
The ranks never outlive the launcher: they ignore Ctrl-C (SIGINT goes to the whole terminal's process
group; the launcher alone handles it), any exception in the launcher (KeyboardInterrupt, or whatever
its SIGTERM handler raises) stops them before it propagates (SIGTERM, then SIGKILL after a grace
period), and a rank whose launcher dies without cleaning up (SIGKILL) exits on its own. A rank that
ends abnormally after reporting its result (a C++ destructor's std::terminate at exit) is named on
stderr; the results stand. A rank holds no named semaphore a stop would leak (its progress bars get a
thread lock), so a stopped run leaves nothing for the resource tracker to warn about.
Under torchrun (RANK/WORLD_SIZE set) it joins the existing launch instead of spawning. A program that
launches many times can have its ranks forked from a server that imported torch once instead
(`fxfuse.runner.rank_server`; the test suite does): the rank then takes over the launcher's environment
and standard streams before it unpickles its function, and ignores SIGINT itself.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxfuse.models.parallel import ParallelContext
from fxfuse.runner.cores import threads_per_rank
from fxfuse.runner.errors import RankFailed
from fxfuse.runner.rank_server import adopt_launcher_state, end_as_a_spawned_rank, launcher_state, rank_start_method
from fxfuse.runner.torchrun import under_torchrun

#: NVLink multicast stays off in every process we start (docs/DESIGN.md, rule 6: the machines are shared).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: Seconds finished ranks get to tear down their process group and exit before they are stopped.
EXIT_GRACE_S = 5.0
#: Seconds a rank gets between SIGTERM and SIGKILL when the launcher stops it.
TERMINATE_GRACE_S = 2.0
#: Exit status of a rank that found its launcher gone.
LAUNCHER_GONE_STATUS = 3
#: Said of a rank that died by SIGKILL without reporting: the launcher sends SIGKILL only when it stops the
#: ranks itself (never while it waits for their results), and SIGKILL is what the out-of-memory killer sends.
OOM_KILLED = (": SIGKILL from outside fxfuse, most likely the kernel's out-of-memory killer (`dmesg` names what it "
              "killed), so it probably ran out of memory")


def free_port() -> int:
    """An unused TCP port on localhost for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world_size: int, device: str, port: int | None, timeout_s: float) -> ParallelContext:
    """Initialize this process's group (gloo for cpu, nccl for cuda) and return its context."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if port is not None:
        kwargs["init_method"] = f"tcp://127.0.0.1:{port}"
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kwargs)
    return ParallelContext.from_group(dist.group.WORLD)


def _rank_main(rank, world_size, device, port, timeout_s, call, launcher, queue):
    # Ctrl-C is the launcher's to handle: a spawned rank inherits this from `_sigint_ignored`, a forked one not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    adopt_launcher_state(launcher)  # forked from the rank server: the launcher's environment and stdio
    # A rank still running shortly before the launcher gives up prints where it is stuck (to stderr).
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=False)
    threading.Thread(target=_exit_when_launcher_dies, name="fxfuse-launcher-watch", daemon=True).start()
    _progress_bars_without_a_semaphore()
    try:
        fn, args = pickle.loads(call)
        torch.manual_seed(0)
        if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: ranks must not oversubscribe the cores
            torch.set_num_threads(threads_per_rank(world_size))
        ctx = init_rank(rank, world_size, device, port, timeout_s)
        # plain pickle (not the queue's shared-memory reducer): tensors in the result must outlive this process
        queue.put((rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException as exc:  # noqa: BLE001 - report every failure to the parent instead of hanging it
        queue.put((rank, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        end_as_a_spawned_rank(launcher)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = 900.0,
) -> list[Any]:
    """Call `fn(ctx, *args)` on `world_size` ranks and return the results in rank order.

    `fn` must be picklable (a module-level function) and return picklable values (tensors are
    copied back, not shared). `timeout_s` bounds both the process group's collectives and the whole
    call: ranks still running after it are killed and `RankFailed` names them. Under torchrun
    the current process is one rank: it runs `fn` once and returns a one-element list with its
    own result (only rank 0 needs to report). Raises `RankFailed` if any rank raised.
    """
    if under_torchrun():
        ctx = init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, None, timeout_s)
        try:
            return [fn(ctx, *args)]
        finally:
            dist.destroy_process_group()
    start_method = rank_start_method()
    mp_ctx = mp.get_context(start_method)
    queue = mp_ctx.SimpleQueue()
    port = free_port()
    # A forked rank takes the launcher's environment before it unpickles the call (rank_server's rules); one
    # pickle per rank, as multiprocessing makes: a tensor's shared memory is handed over once per pickle.
    procs = [
        mp_ctx.Process(target=_rank_main, daemon=True, args=(
            r, world_size, device, port, timeout_s, bytes(ForkingPickler.dumps((fn, args))),
            launcher_state(start_method), queue))
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    finished = False
    try:
        with _sigint_ignored():  # inherited by the ranks: Ctrl-C stops them through the launcher, without tracebacks
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size:
            report = _next_report(queue, procs, results, deadline)
            if report == "timeout":
                hung = [r for r in range(world_size) if r not in results]
                raise RankFailed(
                    f"rank(s) {hung} did not finish within {timeout_s:.0f} s (hung? ranks {sorted(results)} finished)",
                    hung[0], f"TimeoutError: rank(s) {hung} still running after {timeout_s:.0f} s",
                )
            if report is None:
                dead = {r: p.exitcode for r, p in enumerate(procs) if not p.is_alive() and r not in results}
                named = ", ".join(f"rank {r} ({_exit_status(code)})" for r, code in sorted(dead.items()))
                killed = -signal.SIGKILL in dead.values()
                error = f"{named} ended without reporting a result" + (OOM_KILLED if killed else "")
                raise RankFailed(f"{error}; the other ranks were stopped", min(dead), error, killed_for_memory=killed)
            rank, ok, payload = report
            if not ok:
                error, traceback_text = payload
                raise RankFailed(f"rank {rank} failed:\n{traceback_text}", rank, error, traceback_text)
            results[rank] = pickle.loads(payload)
        finished = True
    finally:
        stopped = stop_ranks(procs, EXIT_GRACE_S if finished else 0.0)
    for rank, p in enumerate(procs):
        if p not in stopped and p.exitcode != 0:  # after its result: say which rank wrote whatever it printed
            print(f"fxfuse: rank {rank} ended with {_exit_status(p.exitcode)} after reporting its result "
                  "(the result is complete; any message it printed while exiting came from it)", file=sys.stderr)
    return [results[r] for r in range(world_size)]


def stop_ranks(procs, grace_s: float) -> list:
    """Let the started processes of `procs` exit within `grace_s` seconds, then SIGTERM the rest, and
    SIGKILL what is left `TERMINATE_GRACE_S` seconds later; returns, once every one has ended, those it
    had to stop."""
    started = [p for p in procs if p.pid is not None]
    deadline = time.monotonic() + grace_s
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in started if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    return alive


def _exit_status(code: int) -> str:
    """A process exit code in words: `status 1`, or the signal's name (`SIGABRT`) for a negative one."""
    if code >= 0:
        return f"status {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process while the block runs (in the main thread; elsewhere nothing changes).

    Processes started in the block inherit the ignored disposition, and Python keeps it at start-up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _progress_bars_without_a_semaphore() -> None:
    """In a rank: give tqdm (torch's FX interpreter draws its progress bars with it) a thread lock instead of
    the multiprocessing lock it makes by default. That lock is a named semaphore registered with the
    launcher's resource tracker; a rank the launcher stops (SIGTERM, then SIGKILL) never unregisters it,
    so after Ctrl-C or SIGTERM the tracker warned of leaked semaphores once the launcher had exited. A
    spawned rank shares the lock with no other process, so a thread lock guards the same."""
    try:
        from tqdm import tqdm
    except ImportError:  # no tqdm: torch draws no bars, and makes no lock
        return
    tqdm.set_lock(threading.RLock())


def _exit_when_launcher_dies() -> None:
    """In a rank: wait until the launching process has ended, then end this process at once (the launcher
    normally outlives its ranks; it ends first only when killed without the chance to stop them)."""
    launcher = multiprocessing.parent_process()
    if launcher is not None:
        launcher.join()
        os._exit(LAUNCHER_GONE_STATUS)


def _next_report(queue, procs, reported: dict[int, Any], deadline: float, poll_s: float = 0.05):
    """Next (rank, ok, payload) from the queue, None once a rank died without reporting, or "timeout"
    once `deadline` (time.monotonic) has passed."""
    while True:
        if not queue.empty():
            return queue.get()
        if time.monotonic() > deadline:
            return "timeout"
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reported]
        if dead:
            time.sleep(0.5)  # a rank that reported just before exiting: let its message land
            return queue.get() if not queue.empty() else None
        time.sleep(poll_s)
