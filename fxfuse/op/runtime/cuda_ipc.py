"""Device buffers shared between the ranks of a group over CUDA IPC, created and freed by agreement.

`create_shared_buffers(sizes, group)` allocates one buffer per size on this rank's GPU
(`cudaMalloc`), exchanges IPC handles, and maps every peer's buffers, so that each returned
`SharedBuffer` holds one device pointer per rank. Every step that can fail on one rank only (loading
the runtime, selecting the device, allocation, export, mapping) is followed by an agreement round: on
failure every rank unmaps and frees what it made and raises the same `SharedBufferError`, naming the
rank and the step, so no rank is left waiting in a collective the others skipped, and nothing leaks. `close_shared_buffers(buffers, group)` unmaps the
peers' buffers, waits for every rank to have done so, then frees this rank's own; with `group=None`
(at interpreter exit, when peers may be gone) it only unmaps and frees locally.

The CUDA runtime is reached through ctypes (`CudaRuntime`, the libcudart that torch loaded), so
these buffers work for ranks that share one GPU too. They are raw allocations outside torch's caching
allocator: their address never moves and never returns to a pool a captured CUDA graph might reuse.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxfuse.op.decide.agreement import LocalSteps, all_ranks_agree, describe_failures, gather_objects

logger = logging.getLogger(__name__)

#: Size of a cudaIpcMemHandle_t.
IPC_HANDLE_BYTES = 64
#: cudaIpcMemLazyEnablePeerAccess.
IPC_LAZY_ENABLE_PEER_ACCESS = 1


class SharedBufferError(RuntimeError):
    """Creating the shared buffers failed on some rank; raised on every rank with every rank's error."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]


class CudaRuntime:
    """The few CUDA runtime calls IPC sharing needs, through ctypes; every error raises RuntimeError."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        void_p, size_t, c_int, c_uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        signatures = {
            "cudaGetErrorString": ([c_int], ctypes.c_char_p),
            "cudaSetDevice": ([c_int], c_int),
            "cudaMalloc": ([ctypes.POINTER(void_p), size_t], c_int),
            "cudaFree": ([void_p], c_int),
            "cudaMemset": ([void_p, c_int, size_t], c_int),
            "cudaDeviceSynchronize": ([], c_int),
            "cudaIpcGetMemHandle": ([ctypes.POINTER(_IpcHandle), void_p], c_int),
            "cudaIpcOpenMemHandle": ([ctypes.POINTER(void_p), _IpcHandle, c_uint], c_int),
            "cudaIpcCloseMemHandle": ([void_p], c_int),
        }
        for name, (argtypes, restype) in signatures.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = argtypes, restype

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            message = self._lib.cudaGetErrorString(result).decode()
            raise RuntimeError(f"{what} failed: CUDA error {result} ({message})")

    def set_device(self, index: int) -> None:
        """cudaSetDevice."""
        self._check(self._lib.cudaSetDevice(index), "cudaSetDevice")

    def malloc(self, size: int) -> int:
        """cudaMalloc: a device pointer to `size` bytes."""
        pointer = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(pointer), size), f"cudaMalloc({size})")
        return int(pointer.value)

    def free(self, pointer: int) -> None:
        """cudaFree."""
        self._check(self._lib.cudaFree(pointer), "cudaFree")

    def memset(self, pointer: int, value: int, size: int) -> None:
        """cudaMemset (synchronous with respect to the host for device memory once followed by a sync)."""
        self._check(self._lib.cudaMemset(pointer, value, size), "cudaMemset")

    def synchronize(self) -> None:
        """cudaDeviceSynchronize."""
        self._check(self._lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def ipc_handle(self, pointer: int) -> bytes:
        """cudaIpcGetMemHandle: the handle another process opens to map this allocation."""
        handle = _IpcHandle()
        self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        return bytes(handle.reserved)

    def ipc_open(self, handle: bytes) -> int:
        """cudaIpcOpenMemHandle: this process's pointer to a peer's allocation."""
        pointer = ctypes.c_void_p()
        raw = _IpcHandle()
        ctypes.memmove(raw.reserved, handle, IPC_HANDLE_BYTES)
        self._check(
            self._lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, IPC_LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
        return int(pointer.value)

    def ipc_close(self, pointer: int) -> None:
        """cudaIpcCloseMemHandle: unmap a peer's allocation."""
        self._check(self._lib.cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")


_CUDART_FILE = re.compile(r"libcudart(?:-[0-9a-f]+)?\.so(?:\.\d+)*$")


@functools.cache
def cuda_runtime() -> CudaRuntime:
    """The CUDA runtime library torch loaded (found in /proc/self/maps), else the system's libcudart."""
    torch.cuda.init()
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = [line.split()[-1] for line in maps if _CUDART_FILE.search(line.strip())]
    except OSError:
        pass
    for path in dict.fromkeys(candidates + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]):
        try:
            return CudaRuntime(ctypes.CDLL(path))
        except OSError:
            continue
    raise RuntimeError("cannot find the CUDA runtime library (libcudart) that torch uses")


@dataclass
class SharedBuffer:
    """One buffer per rank of a group: `pointers[r]` is rank r's buffer as this process sees it."""

    rank: int
    size: int
    pointers: list[int]
    closed: bool = field(default=False, compare=False)

    @property
    def local(self) -> int:
        """This rank's own buffer."""
        return self.pointers[self.rank]


def create_shared_buffers(
    sizes: list[int], group: dist.ProcessGroup, runtime: CudaRuntime | None = None, device_index: int | None = None,
    initial_byte: int | None = None,
) -> list[SharedBuffer]:
    """Allocate `sizes` bytes on every rank of `group` (on GPU `device_index`, default torch's current
    one) and map every peer's buffers (collective). With `initial_byte`, every byte of each buffer is set
    to it (and the device synchronized) before its handle is exported, so no peer can write into it first.

    Every local step (loading the CUDA runtime, selecting the device, allocating, exporting, opening
    the peers' handles) runs before an exchange that carries its failure to every rank. Raises
    SharedBufferError on every rank, naming the ranks and steps that failed, if any rank fails; then
    nothing stays allocated or mapped.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    steps = LocalSteps()
    runtime = runtime or steps.run("loading the CUDA runtime", cuda_runtime)
    own: list[int] = []
    handles: list[bytes] = []
    if runtime is not None:  # nothing below may raise here: each call is a step whose failure is exchanged
        steps.run("selecting the GPU (cudaSetDevice)", lambda: runtime.set_device(
            torch.cuda.current_device() if device_index is None else device_index))
        for size in sizes:
            pointer = steps.run("allocating the shared buffers (cudaMalloc)", runtime.malloc, size)
            if pointer is not None:
                own.append(pointer)
                if initial_byte is not None:
                    steps.run("initializing the shared buffers (cudaMemset)", runtime.memset, pointer, initial_byte, size)
                    steps.run("initializing the shared buffers (cudaDeviceSynchronize)", runtime.synchronize)
                handles.append(steps.run("exporting IPC handles (cudaIpcGetMemHandle)", runtime.ipc_handle, pointer))
    exchanged = gather_objects((handles, steps.failure), group)
    failed = describe_failures([failure for _, failure in exchanged])
    if failed is not None:
        if runtime is not None:
            _free_all(runtime, own)
        raise SharedBufferError(f"allocating shared buffers failed: {failed}")

    mapped: list[list[int]] = [[0] * world_size for _ in sizes]
    opened: list[int] = []
    steps = LocalSteps()
    for peer in range(world_size):
        for i, handle in enumerate(exchanged[peer][0]):
            if peer == rank:
                mapped[i][peer] = own[i]
                continue
            pointer = steps.run("opening the peers' IPC handles (cudaIpcOpenMemHandle)", runtime.ipc_open, handle)
            if pointer is not None:
                mapped[i][peer] = pointer
                opened.append(pointer)
    failed = describe_failures(gather_objects(steps.failure, group))
    if failed is not None:
        for pointer in opened:
            _quietly(runtime.ipc_close, pointer)
        all_ranks_agree(True, 0, group)  # every rank unmapped before anyone frees
        _free_all(runtime, own)
        raise SharedBufferError(f"mapping peers' shared buffers failed: {failed}")
    return [SharedBuffer(rank, size, mapped[i]) for i, size in enumerate(sizes)]


def close_shared_buffers(buffers: list[SharedBuffer], group: dist.ProcessGroup | None, runtime: CudaRuntime | None = None) -> None:
    """Unmap the peers' buffers, wait for every rank (when `group` is given), then free this rank's own.

    Without a group (at exit) nothing waits for peers; a buffer closed before is skipped.
    """
    runtime = runtime or cuda_runtime()
    live = [b for b in buffers if not b.closed]
    for buffer in live:
        for peer, pointer in enumerate(buffer.pointers):
            if peer != buffer.rank and pointer:
                _quietly(runtime.ipc_close, pointer)
    if group is not None:
        all_ranks_agree(True, 0, group)
    for buffer in live:
        _quietly(runtime.free, buffer.local)
        buffer.closed = True


def _free_all(runtime: CudaRuntime, pointers: list[int]) -> None:
    for pointer in pointers:
        _quietly(runtime.free, pointer)


def _quietly(call, pointer: int) -> None:
    """Release one resource, logging instead of raising: teardown goes on with the others."""
    try:
        call(pointer)
    except Exception:  # noqa: BLE001 - best effort; the remaining resources still get released
        logger.debug("releasing %#x failed", pointer, exc_info=True)
