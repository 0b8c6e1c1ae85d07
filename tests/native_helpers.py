"""Shared by the tests that drive the fused op's C++ fallback on CPU: its library, built into a folder."""

from __future__ import annotations

import os

import pytest


def build_native_library(folder) -> str:
    """Build the C++ fallback's library into `folder` (the cache that ranks given its path load it from)
    and return the path as a string; skip the calling test where this machine has no C++ compiler."""
    from fxfuse.op.kernels.native_build import build, compiler, library_path

    if compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    previous = os.environ.get("FXFUSE_NATIVE_CACHE")
    os.environ["FXFUSE_NATIVE_CACHE"] = str(folder)
    try:
        build(compiler(), library_path(compiler()))
    finally:
        if previous is None:
            del os.environ["FXFUSE_NATIVE_CACHE"]
        else:
            os.environ["FXFUSE_NATIVE_CACHE"] = previous
    return str(folder)
