"""The Triton kernel behind `fxfuse.op.kernels.one_shot_all_reduce_norm` (imported on its first launch): a
one-shot all-reduce over peer-mapped buffers whose epilogue is the fused op's add + RMSNorm (+ FP8), in one
launch.

The protocol (Lamport's: the data is its own flag). Each rank owns a receive buffer of 3 generations x
world_size senders x capacity rows x hidden 16-bit elements, all set to `SENTINEL` (0xFFFF, a NaN in
bfloat16 and float16) when made, and every rank maps every other rank's buffer. A call of generation
g = flags[0]:
  1. pushes each of its rows into slot [g, own rank] of every rank's buffer (its own included); an input
     element that is the sentinel itself is sent as `NAN_BITS` (another NaN, so a NaN stays a NaN);
  2. resets to the sentinel the rows the previous generation (g + 2) % 3 received (flags[2 + it] rows,
     all senders), which no peer can write again before this rank's next push (see below);
  3. for each of its rows, waits until no element of slot [g, s] is the sentinel, for s = 0..world_size-1
     in that order, summing in float32 (the same order on every rank: every rank gets the same bits),
     rounds the sum to the activations' dtype, then runs the epilogue;
  4. the last program to finish (an atomic count of arrivals in flags[1]) records the rows this
     generation received (flags[2 + g]), zeroes the count and advances flags[0] to (g + 1) % 3.
Why three generations suffice: a peer writes this rank's generation-g slot again at its call n + 3, which
needs this rank's push of call n + 2, which this rank makes after its call n + 1, the one that cleared
generation g, has finished (stream order). The generation lives in device memory and only ever takes the
values 0, 1, 2, so CUDA-graph replays advance it, and it never wraps.

Every program pushes all its rows before it waits for any: a program never waits on data that another
program of its own rank has yet to send. The launch has at most one program per SM (the caller's
`programs`), so all of them are resident together and the wait ends once every peer has launched.
"""

import triton
import triton.language as tl

from fxfuse.op.kernels.add_rmsnorm_fp8_triton import quantize_tile
from fxfuse.op.kernels.add_rmsnorm_triton import add_rmsnorm_tile

#: The receive buffers' empty value (the 16-bit pattern 0xFFFF, read as int16): a NaN no torch
#: operation produces (torch's NaN is 0x7FC0 in bfloat16, 0x7E00 in float16).
SENTINEL = tl.constexpr(-1)
#: What an input element equal to the sentinel is sent as: 0x7FFF, also a NaN in both dtypes.
NAN_BITS = tl.constexpr(32767)


@triton.jit
def arrived(received, mask):
    """The tile at `received` once none of its elements is the sentinel (a peer's push has landed), read
    past the caches on every try."""
    bits = tl.load(received, mask=mask, other=0, volatile=True)
    while tl.max(tl.max((bits == SENTINEL).to(tl.int32), axis=1), axis=0) > 0:
        bits = tl.load(received, mask=mask, other=0, volatile=True)
    return bits


@triton.jit
def buffer_of(buffer0, buffer1, buffer2, buffer3, buffer4, buffer5, buffer6, buffer7, rank: tl.constexpr):
    """Rank `rank`'s receive buffer (the choice made at compile time: each buffer is a pointer argument, so
    Triton knows it is 16-byte aligned and moves rows in 16-byte accesses, not element by element)."""
    if rank == 0:
        return buffer0
    elif rank == 1:
        return buffer1
    elif rank == 2:
        return buffer2
    elif rank == 3:
        return buffer3
    elif rank == 4:
        return buffer4
    elif rank == 5:
        return buffer5
    elif rank == 6:
        return buffer6
    else:
        return buffer7


@triton.jit(do_not_specialize=["tokens", "capacity", "programs", "rank", "groups"])
def one_shot_all_reduce_rows(
    own, buffer0, buffer1, buffer2, buffer3, buffer4, buffer5, buffer6, buffer7, flags_ptr, x_ptr, residual_ptr,
    weight_ptr, residual_out_ptr, normed_ptr, quantized_ptr, scales_ptr, static_scale_ptr, tokens, hidden, capacity,
    programs, rank, groups, eps, min_amax, divisor, min_scale, clamp_bound, WORLD_SIZE: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, SCALING: tl.constexpr,
    SCALE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, POWER_OF_TWO: tl.constexpr, BOUND_AFTER_POWER_OF_TWO: tl.constexpr,
    RECIPROCAL: tl.constexpr, SATURATE: tl.constexpr, CAST_SATURATES: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    # own: this rank's receive buffer; buffer0..buffer<WORLD_SIZE - 1>: every rank's, as this process maps them
    # (the others unused). A buffer's row r of slot (generation g, sender s) is its row (g * WORLD_SIZE + s) *
    # capacity + r. flags_ptr: int32[5], this rank's [generation, arrivals, rows received by generation 0, 1, 2].
    # EPILOGUE: 0 writes the sum into normed_ptr (the all-reduce-only op), 1 the add + norm, 2 the add + norm +
    # FP8. Program p takes rows p, p + programs, ...; each row is a [ROWS, COLS] tile, as in add_rmsnorm_fp8_rows.
    pid = tl.program_id(0).to(tl.int64)
    generation = tl.load(flags_ptr, volatile=True)
    previous = (generation + 2) % 3
    previous_rows = tl.load(flags_ptr + 2 + previous, volatile=True)
    cols = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    mask = cols < hidden
    pushed_to = (generation * WORLD_SIZE + rank).to(tl.int64) * capacity
    for row in range(pid, tokens, programs):
        offsets = row * hidden + cols
        bits = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        bits = tl.where(bits == SENTINEL, NAN_BITS, bits)
        for peer in tl.static_range(WORLD_SIZE):
            receiver = buffer_of(buffer0, buffer1, buffer2, buffer3, buffer4, buffer5, buffer6, buffer7, peer)
            tl.store(receiver + (pushed_to + row) * hidden + cols, bits, mask=mask)
    tl.debug_barrier()  # every push is issued before this program's clearing and waiting
    empty = tl.full([ROWS, COLS], SENTINEL, tl.int16)
    for row in range(pid, previous_rows, programs):
        for sender in tl.static_range(WORLD_SIZE):
            cleared = (previous * WORLD_SIZE + sender).to(tl.int64) * capacity + row
            tl.store(own + cleared * hidden + cols, empty, mask=mask)
    tl.debug_barrier()
    dtype = x_ptr.dtype.element_ty
    received_from = (generation * WORLD_SIZE).to(tl.int64) * capacity
    for row in range(pid, tokens, programs):
        offsets = row * hidden + cols
        total = arrived(own + (received_from + row) * hidden + cols, mask).to(dtype, bitcast=True).to(tl.float32)
        for sender in tl.static_range(1, WORLD_SIZE):
            received = own + (received_from + sender * capacity + row) * hidden + cols
            total += arrived(received, mask).to(dtype, bitcast=True).to(tl.float32)
        reduced = total.to(dtype)
        if EPILOGUE == 0:
            tl.store(normed_ptr + offsets, reduced, mask=mask)
        else:
            normed = add_rmsnorm_tile(reduced, residual_ptr, weight_ptr, residual_out_ptr, normed_ptr, offsets, cols, mask,
                                      hidden, eps, HAS_RESIDUAL, STORE_NORMED, WEIGHT_IN_FP32, WEIGHT_OFFSET)
            if EPILOGUE == 2:
                quantize_tile(normed, row, offsets, mask, quantized_ptr, scales_ptr, static_scale_ptr, groups,
                              min_amax, divisor, min_scale, clamp_bound, SCALING, SCALE_ROUNDING, ROWS, COLS, POWER_OF_TWO,
                              BOUND_AFTER_POWER_OF_TWO, RECIPROCAL, SATURATE, CAST_SATURATES, LIBDEVICE)
    tl.debug_barrier()  # this program's reads of the flags and its clearing precede its arrival
    arrivals = tl.atomic_add(flags_ptr + 1, 1)
    if arrivals == programs - 1:
        tl.store(flags_ptr + 2 + generation, tokens)
        tl.atomic_xchg(flags_ptr + 1, 0)
        tl.atomic_xchg(flags_ptr, (generation + 1) % 3)
