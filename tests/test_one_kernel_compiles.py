"""The one-kernel PCIe path's Triton kernel compiled for CUDA GPUs on a machine without one (Triton's compiler and
its bundled ptxas need no device), and what its PTX must show.

The interpreter (tests/test_one_kernel_pcie.py) checks what the kernel computes; only the compiler shows how it
moves data and synchronises, which is where a kernel of this kind goes wrong on hardware:
- every row moves in 16-byte accesses: the pushes into the peers' buffers, the clearing and the waits (a
  kernel that lost the buffers' alignment moves 2-byte elements, one PCIe transaction each);
- the waits read past the caches (`ld.volatile`), or a peer's push would never be seen;
- one thread per program counts the program's arrival (`atom ... acq_rel`), and the generation advances by
  atomic exchange: a count per thread would advance it before every program is done (read by hand in the PTX of
  Triton 3.6, the GPU machine's, and 3.9: the predicate is thread 0; the test accepts both spellings).
For SM 9.0 (Hopper, the lent test GPU) and SM 12.0 (the RTX PRO 6000 PCIe boxes the path is for), at world
sizes 2 and 8, for the norm and FP8 epilogues.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

def compiled_ptx(world_size: int, sm: int, fp8: bool, tmp_path) -> str:
    """The kernel's PTX, compiled by tests/one_kernel_ptx.py in a process of its own (this one runs Triton's
    interpreter, under which a kernel cannot be compiled)."""
    out = tmp_path / "kernel.ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("one_kernel_ptx.py")), str(world_size), str(sm),
                           str(int(fp8)), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out.read_text()


@pytest.mark.parametrize("world_size, sm, fp8", [(2, 90, False), (8, 90, True), (8, 120, False), (2, 120, True)])
def test_the_kernel_compiles_with_wide_accesses_uncached_waits_and_one_arrival_per_program(world_size, sm, fp8, tmp_path):
    ptx = compiled_ptx(world_size, sm, fp8, tmp_path)
    assert not re.findall(r"(?:ld|st)(?:\.volatile)?\.global(?:\.cs)?\.b16 ", ptx), "2-byte accesses: the alignment was lost"
    waits = re.findall(r"ld\.volatile\.global\.v4\.b32", ptx)
    assert len(waits) >= world_size  # every sender's rows, 16 bytes a load, past the caches
    pushes = re.findall(r"st\.global\.v4\.b32", ptx)
    assert len(pushes) >= 2 * world_size  # a push to every rank and the clearing of every sender's rows
    arrival = re.findall(r"@(%p\d+) atom\.global\.gpu\.acq_rel\.add\.u32", ptx)
    advances = re.findall(r"@(%p\d+) atom\.global\.gpu\.acq_rel\.exch\.b32", ptx)
    assert len(arrival) == 1 and len(advances) == 2  # predicated: one thread of the program
    assert first_thread_only(ptx, arrival[0]), "the arrival is not one thread's"


def first_thread_only(ptx: str, predicate: str) -> bool:
    """Whether `predicate` is "thread 0" as the Triton versions seen write it: `tid == 0` (3.9), or `lane == 0 and
    tid < 32` (3.6)."""
    def defined_as(pattern: str, name: str):
        return re.search(rf"{pattern.replace('P', re.escape(name))}", ptx)

    if defined_as(r"setp\.eq\.b32\s+P, %r\d+, 0;", predicate):
        return True
    both = defined_as(r"and\.pred\s+P, (%p\d+), (%p\d+);", predicate)
    return bool(both) and {bool(defined_as(r"setp\.eq\.b32\s+P, %r\d+, 0;", p)) or bool(defined_as(r"setp\.lt\.u32\s+P, %r\d+, 32;", p))
                           for p in both.groups()} == {True}
