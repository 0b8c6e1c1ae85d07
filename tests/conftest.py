"""Session set-up shared by every test:
- on a machine without CUDA, Triton kernels run in Triton's CPU interpreter (the variable must be set
  before the first `triton.jit` runs: Triton decides per kernel when it is decorated, so it is set here,
  before any test module imports a kernel);
- on such a machine ranks are forked from a server that imported torch's compile stack once
  (`fxfuse.runner.rank_server`) instead of each importing it (the suite launches ranks about 60 times;
  `fxfuse` commands the tests run as subprocesses still spawn theirs, as a user's do);
- the slowest test files are collected first, so that `scripts/dev test` (pytest-xdist, a file to a worker, in
  collection order: `--no-loadscope-reorder`) starts them first and ends on short files on both workers."""

import os

import pytest
import torch
from native_helpers import build_native_library

from fxfuse.runner.rank_server import start_ranks_from_server

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    start_ranks_from_server()


#: The test files that take longest, slowest first: seconds of one worker in a whole run on 2 cores
#: (`scripts/dev test --durations=0`, summed per file, 2026-12-06): 247, 231, 152, 98, 91, 81, 72, 71, 60, 50, 50.
#: Every other file follows in its usual order. A stale entry only costs balance, never a test.
SLOWEST_FILES = ("test_fp8_fuzz.py", "test_report.py", "test_differential.py", "test_post_grad_pass.py",
                 "test_compile_cache.py", "test_third_party_tp.py", "test_fp8_epilogue.py", "test_model_fusion.py",
                 "test_bench_fallback.py", "test_cli_signals.py", "test_hf_generate.py")


def pytest_collection_modifyitems(items: list) -> None:
    """Collect `SLOWEST_FILES` first, slowest first (a stable sort: each file's tests keep their order)."""
    position = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: position.get(item.path.name, len(SLOWEST_FILES)))


@pytest.fixture(scope="session")
def native_library(tmp_path_factory) -> str:
    """A folder holding the C++ fallback's library, built once for the session (about 15 s of one core per
    build): the tests that load it from a cache folder only read it, so they share this one. Skips the
    calling test where this machine has no C++ compiler."""
    return build_native_library(tmp_path_factory.mktemp("native"))
