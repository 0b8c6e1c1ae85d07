"""Session set-up shared by every test:
- on a machine without CUDA, Triton kernels run in Triton's CPU interpreter (the variable must be set
  before the first `triton.jit` runs: Triton decides per kernel when it is decorated, so it is set here,
  before any test module imports a kernel);
- on such a machine ranks are forked from a server that imported torch's compile stack once
  (`fxfuse.runner.rank_server`) instead of each importing it (the suite launches ranks about 60 times;
  `fxfuse` commands the tests run as subprocesses still spawn theirs, as a user's do);
- the slowest files run first (`SLOWEST_FIRST`), so that `scripts/dev test`'s two workers (a file each at a
  time) finish together instead of one waiting on the other's last long file."""

import os

import pytest
import torch
from native_helpers import build_native_library

from fxfuse.runner.rank_server import start_ranks_from_server

#: Test files that take a minute or more of a worker on 2 cores, slowest first (the durations list at the
#: end of `scripts/dev test` shows when this needs updating); every other file follows in its usual order.
SLOWEST_FIRST = ("test_report.py", "test_fp8_fuzz.py", "test_differential.py", "test_model_fusion.py",
                 "test_compile_cache.py", "test_post_grad_pass.py", "test_third_party_tp.py",
                 "test_quant_compile.py", "test_fp8_epilogue.py", "test_cli_signals.py", "test_bench_fallback.py",
                 "test_native_fallback.py")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    start_ranks_from_server()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the items of `SLOWEST_FIRST`'s files first, in that order (a stable sort: each file's own order stays)."""
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def native_library(tmp_path_factory) -> str:
    """A folder holding the C++ fallback's library, built once for the session (about 15 s of one core per
    build): the tests that load it from a cache folder only read it, so they share this one. Skips the
    calling test where this machine has no C++ compiler."""
    return build_native_library(tmp_path_factory.mktemp("native"))
