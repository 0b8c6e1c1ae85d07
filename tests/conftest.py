"""Session set-up shared by every test:
- on a machine without CUDA, Triton kernels run in Triton's CPU interpreter (the variable must be set
  before the first `triton.jit` runs: Triton decides per kernel when it is decorated, so it is set here,
  before any test module imports a kernel);
- on such a machine ranks are forked from a server that imported torch's compile stack once
  (`fxfuse.runner.rank_server`) instead of each importing it (the suite launches ranks about 60 times;
  `fxfuse` commands the tests run as subprocesses still spawn theirs, as a user's do)."""

import os

import pytest
import torch
from native_helpers import build_native_library

from fxfuse.runner.rank_server import start_ranks_from_server

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    start_ranks_from_server()


@pytest.fixture(scope="session")
def native_library(tmp_path_factory) -> str:
    """A folder holding the C++ fallback's library, built once for the session (about 15 s of one core per
    build): the tests that load it from a cache folder only read it, so they share this one. Skips the
    calling test where this machine has no C++ compiler."""
    return build_native_library(tmp_path_factory.mktemp("native"))
