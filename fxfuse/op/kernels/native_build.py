"""Compiling and loading the fused op's C++ fallback (`native_fallback.cpp`), once per machine.

The library is compiled with the system C++ compiler (`$CXX`, else `c++`) against the installed
torch's headers and libraries, and loaded with `torch.ops.load_library`; it needs no CUDA toolkit
and no Python headers (it only uses torch's dispatcher, ATen and c10d's group registry). Builds are
cached under `$FXFUSE_NATIVE_CACHE` (default `~/.cache/fxfuse/native`, or a folder under the temporary
directory when the user has no home, as containers running under an arbitrary UID do), keyed by the
source, the torch version and the compiler, so the first build on a machine (about 20 s) is the only
one; ranks that start together wait for one build under a file lock. A cached library that does not
load (a corrupt file) is rebuilt once. `FXFUSE_NATIVE=0` turns the C++ path off (the op then runs its
Python kernel, which computes the same results with more host time per call).

`load_native_library()` returns None with the reason logged once when there is no compiler, no
writable cache or the build fails: the C++ path is an optimization, never a requirement, and none of
its failures escapes (whether a rank has it changes no collective it issues).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fxfuse.op.decide.environment import env_setting, switch_setting

SOURCE = Path(__file__).with_name("native_fallback.cpp")
BUILD_TIMEOUT_S = 600
log = logging.getLogger(__name__)


def native_enabled() -> bool:
    """False when `FXFUSE_NATIVE=0` (or false, no, off) asks for the Python kernel only; ValueError for a value
    that is neither on nor off."""
    return switch_setting("FXFUSE_NATIVE", True)


def cache_dir() -> Path:
    """Where built libraries are kept: $FXFUSE_NATIVE_CACHE, else ~/.cache/fxfuse/native, else (no home
    directory) fxfuse-native-<uid> in the temporary directory."""
    explicit = env_setting("FXFUSE_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    home = os.path.expanduser("~")
    if home.startswith("~"):  # neither $HOME nor a passwd entry
        return Path(tempfile.gettempdir()) / f"fxfuse-native-{os.getuid()}"
    return Path(home) / ".cache" / "fxfuse" / "native"


def compiler() -> str | None:
    """The C++ compiler to use, or None if there is none on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def compile_command(cxx: str, source: Path, output: Path) -> list[str]:
    """The compiler call that builds `source` into the shared library `output` for the installed torch."""
    torch_dir = Path(torch.__file__).parent
    return [
        cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-I", str(torch_dir / "include"), "-I", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        str(source), "-o", str(output),
        "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def library_path(cxx: str) -> Path:
    """The cached library's path for this source, torch and compiler."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{os.path.realpath(cxx)}".encode())
    return cache_dir() / f"fxfuse_native_{digest.hexdigest()[:16]}.so"


def build(cxx: str, target: Path) -> None:
    """Compile into `target` (atomically: a temporary file renamed into place); raises on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        print(f"fxfuse: compiling the C++ fallback op into {target} (once per machine, ~20 s)", file=sys.stderr, flush=True)
        done = subprocess.run(compile_command(cxx, SOURCE, output), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(output, target)


@functools.cache
def load_native_library() -> Path | None:
    """Build (if not cached) and load the C++ fallback; its path, or None (reason logged) if unavailable.

    Loading defines the `torch.ops.fxfuse_native` ops; it happens at most once per process."""
    if not native_enabled():
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("fxfuse: no C++ compiler (set CXX or install c++): the fused op's fallback runs its Python kernel")
        return None
    try:
        target = library_path(cxx)
        target.parent.mkdir(parents=True, exist_ok=True)
        _build_once(cxx, target, replace=False)
        try:
            torch.ops.load_library(str(target))
        except OSError as error:  # a corrupt or truncated cached file: build it again, once
            log.warning("fxfuse: the cached C++ fallback %s does not load (%s): rebuilding it", target, error)
            _build_once(cxx, target, replace=True)
            torch.ops.load_library(str(target))
    except Exception as error:  # noqa: BLE001 - the C++ path is optional: any failure leaves the Python kernel
        log.warning("fxfuse: the C++ fallback op is unavailable (%s): the fused op's fallback runs its Python kernel", error)
        return None
    return target


def _build_once(cxx: str, target: Path, replace: bool) -> None:
    """Build `target` under the cache's file lock, unless it exists (and `replace` is False)."""
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if replace or not target.exists():
            build(cxx, target)
