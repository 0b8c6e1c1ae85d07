"""`fxfuse bench fallback`: the fused op's NCCL fallback against the unfused graph Inductor compiles, on one GPU.

Where no fused all-reduce runs (a one-rank NCCL group here, tokens above a workspace, a machine
without one), the fused op must cost no more than what it replaced, with or without an FP8
quantization after the norm. For each quantization kind (`--quant`, the blocks of
`fxfuse.bench.fallback_blocks`: the norm alone, per-token-group, per-row or static per-tensor FP8)
and each shape mode (`--modes`), this benchmark compiles the same block twice:
- `inductor`: `torch.compile(backend="inductor")`: NCCL all-reduce re-inplaced into x, then
  Inductor's own add-RMSNorm(-quantization) code;
- `fxfuse`: `torch.compile(backend=FxfuseBackend(fuse_without_fast_kernel=True))`: the same graph with
  the site fused, so the fused op runs its NCCL plan (all-reduce in the donated x, then the fused
  add-RMSNorm kernel); where the norm feeds code Inductor would fuse into it and the op cannot fold (a
  clamp and a scale, a second norm, an FP8 quantization with `--without fp8_epilogue`), the site is in
  tier (b): the all-reduce-only op on its NCCL plan, then Inductor's own add, norm and epilogue.
Shape modes: `static` (`dynamic=False`: one compile per token count, as engines that capture one
graph per width compile) and `dynamic` (`dynamic=True`: one graph for every count above 1, where
Inductor's own code is slower). Both variants are captured in CUDA graphs of `--iters` calls and
replayed in interleaved rounds; each point reports the median (and p25/p75) over `--repeats` samples
in microseconds per call, and the ratio fxfuse / inductor. The captured calls cycle through copies of
the point's input and residual (`--input-sets`; by default enough to cover twice the L2 cache), so that
no call reads what the previous one left in L2: in a model the layers' weights stream through L2
between two sites. With one set (the earlier reports), points whose data about fills L2 (1024 tokens
on an H200) measured whichever variant the cache happened to favour: 1.165 in one run and 0.88 in
the next for the same point. Every point checks both variants against a
float32 reference (`fallback_blocks.check_outputs`: FP8 outputs dequantized, within one e4m3 step;
scales within `SCALE_TOLERANCE`), and records what the fxfuse backend fused in each graph it compiled
(its fused-op nodes, and whether the quantization went into the op: `allreduce_residual_rmsnorm_fp8`).
It also measures the host cost per call outside CUDA graphs (each block at 1 token, per mode).
One process, one GPU, NCCL with one rank: the numbers say what the fallback costs, not what fusing
saves (that needs two or more GPUs).

Cost of the default sweep (hidden 7168 and 4096, 13 token counts, 4 kinds, 2 modes): 208 points and
about 240 compiles of a small graph (static: 2 per point; dynamic: 2 per variant and block, the 1-token
graph and the rest); the report records the seconds spent in first calls (`first_call_s`, compiles
included) and in total (`wall_s`). `--time-budget-s` stops starting points after that many seconds and
lists the rest as skipped.

Writes bench/results/fallback_<gpu>_<stamp>.json (fields gpu, world_size, versions, date, command,
rows: [{tokens, hidden, quant, dynamic, fused_us, inductor_us, ratio, quartiles, check, fusion}],
fusion, host_cost, op_parts, skipped, fxfuse_without) and .md (`fxfuse.bench.fallback_report`).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
import traceback
from typing import Callable

import torch

from fxfuse.bench.arguments import FALLBACK_DESCRIPTION, add_fallback_arguments, check_fallback_arguments
from fxfuse.bench.fallback_blocks import BLOCKS, EPS, block_inputs, check_outputs, fp32_reference
from fxfuse.bench.fallback_report import failures, file_stem, markdown
from fxfuse.bench.output import one_gpu_arguments, package_versions, publish, report_header, write_result_files
from fxfuse.bench.replay import interleaved_wall_us, replay_timings
from fxfuse.passes.config import PATTERNS
from fxfuse.runner.launch import run_on_ranks

#: The fused op's overloads by name as graph snapshots count them; the FP8 variant where it exists.
NORM_OP = "fxfuse.allreduce_residual_rmsnorm"
FP8_OP = "fxfuse.allreduce_residual_rmsnorm_fp8"
#: L2 size assumed where torch does not report it (above every current GPU's, so more input copies, never fewer).
UNKNOWN_L2_BYTES = 128 << 20
#: Variant -> the prefix of its fields in the rows (`inductor_us`, `fused_us`, ...).
FIELD = {"inductor": "inductor", "fxfuse": "fused"}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on one GPU, write its files, return the exit status (1 if a check failed)."""
    args, status = one_gpu_arguments(argv, "fxfuse bench fallback", FALLBACK_DESCRIPTION, add_fallback_arguments,
                                     check_fallback_arguments)
    if status is not None:
        return status
    options = {name: list(dict.fromkeys(getattr(args, name))) for name in ("tokens", "hidden", "quant", "modes")}
    options.update(repeats=args.repeats, iters=args.iters, host_calls=args.host_calls, time_budget_s=args.time_budget_s,
                   input_sets=args.input_sets, without=list(args.without))
    report = run_on_ranks(bench_rank, 1, options, device="cuda", timeout_s=1800)[0]
    publish(report, "fallback", argv, lambda r: write_result_files(
        args.out_dir / file_stem(r), r, markdown(r), lambda path: False), markdown)
    problems = failures(report)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def fused_op_names() -> list[str]:
    """The fused op's overload packets by name (`fxfuse.allreduce_residual_rmsnorm`, and
    `fxfuse.allreduce_residual_rmsnorm_fp8` once the op has that variant)."""
    import fxfuse.op.runtime.registration  # noqa: F401 - gives torch.ops.fxfuse its kernels

    packets = (torch.ops.fxfuse.allreduce_residual_rmsnorm, getattr(torch.ops.fxfuse, FP8_OP.split(".")[1], None))
    return [str(packet) for packet in packets if packet is not None]


def graph_fusion(record, quant: str) -> dict:
    """What one fxfuse compile did: all-reduce sites before the passes, fused-op nodes by op name after,
    whether the site is fused (as many fused-op nodes as sites), its tier (`fxfuse.passes.site_tiers`: "a"
    fused, "b" the all-reduce-only op with the add and norm left to Inductor, "c" Inductor's all-reduce)
    and, with a quantization, whether it went into the op (an `..._fp8` node; None for `none`)."""
    ops = {name: record.after.op_counts[name] for name in fused_op_names() if record.after.op_counts[name]}
    sites = record.stats.allreduces_before
    fused = sites > 0 and sum(ops.values()) >= sites
    tier = "a" if fused else "b" if sites > 0 and record.stats.fast_all_reduces >= sites else "c"
    return {"allreduce_sites": sites, "fused_ops": ops, "site_fused": fused, "tier": tier,
            "quant_fused": None if quant == "none" else ops.get(FP8_OP, 0) > 0}


class Variants:
    """One block (quantization kind) compiled both ways for one shape mode; the fxfuse backends' records.

    `next_point()` returns {"inductor": fn, "fxfuse": fn} for the next point, also `current` until the
    next call: with static shapes a fresh pair for every point (after `torch._dynamo.reset()`, so each
    point compiles once and no recompile limit is reached), with dynamic shapes one pair for all
    points. `compiler` "eager" runs both graphs uncompiled after the passes (the CPU smoke test: no
    code generation).
    """

    def __init__(self, quant: str, dynamic: bool, compiler: str = "inductor", without: tuple[str, ...] = ()):
        self.quant, self.dynamic, self.compiler = quant, dynamic, compiler
        self.patterns = tuple(pattern for pattern in PATTERNS if pattern not in without)
        self.backends: list = []
        self.current: dict[str, Callable] | None = None

    def next_point(self) -> dict[str, Callable]:
        """The two compiled variants that serve the next point (compiled lazily, on their first call)."""
        from fxfuse.backend import FxfuseBackend

        if self.current is None or not self.dynamic:
            torch._dynamo.reset()
            backend = FxfuseBackend(inner=self.compiler, patterns=self.patterns, fuse_without_fast_kernel=True)
            self.backends.append(backend)
            block = BLOCKS[self.quant]
            self.current = {
                "inductor": torch.compile(block, backend=self.compiler, fullgraph=True, dynamic=self.dynamic),
                "fxfuse": torch.compile(block, backend=backend, fullgraph=True, dynamic=self.dynamic),
            }
        return self.current

    @property
    def records(self) -> list:
        """Every fxfuse compile so far, in order (one per point with static shapes)."""
        return [record for backend in self.backends for record in backend.records]

    def summary(self, hidden: int) -> dict:
        """The fusion entry of the report: each fxfuse graph's `graph_fusion`."""
        return {"hidden": hidden, "quant": self.quant, "dynamic": self.dynamic,
                "graphs": [graph_fusion(record, self.quant) for record in self.records]}


def checked_point(variants: Variants, tokens: int, hidden: int, device: torch.device, group_name: str) -> tuple[dict, tuple]:
    """Run both variants once at a point (compiling where needed) and check them against float32.

    Returns the row without timings (tokens, hidden, quant, dynamic, `check` per variant, `ok`,
    `first_call_s` per variant, `fusion`: the fxfuse graph serving the point, i.e. the one compiled
    for it, or under dynamic shapes the newest) and the point's inputs.
    """
    quant = variants.quant
    inputs = block_inputs(quant, tokens, hidden, device)
    reference = fp32_reference(quant, inputs)
    compiled = variants.next_point()
    row = {"tokens": tokens, "hidden": hidden, "quant": quant, "dynamic": variants.dynamic,
           "check": {}, "first_call_s": {}}
    for name, fn in compiled.items():
        began = time.perf_counter()
        outputs = fn(*inputs, group_name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["first_call_s"][name] = time.perf_counter() - began
        row["check"][name] = check_outputs(quant, outputs, reference)
    row["fusion"] = graph_fusion(variants.records[-1], quant)
    row["ok"] = all(check["ok"] for check in row["check"].values()) and row["fusion"]["tier"] != "c"
    return row, inputs


@torch.no_grad()
def bench_rank(ctx, options: dict) -> dict:
    """Compile, check and time every (hidden, quantization, mode, tokens) point, within the time budget."""
    import fxfuse
    from fxfuse.op.kernels.native_fallback import native_installed
    from fxfuse.op.runtime.plans import fusion_stats

    started = time.monotonic()
    device = torch.device("cuda", torch.cuda.current_device())
    options = {**options, "l2_bytes": l2_cache_bytes(device)}
    group_name = ctx.group.group_name
    rows, fusion, host_rows, parts, skipped = [], [], [], [], []
    for hidden in options["hidden"]:
        fxfuse.prepare(ctx.group, hidden, torch.bfloat16, max(options["tokens"]))
        measured = False
        for quant in options["quant"]:
            for mode in options["modes"]:
                variants = Variants(quant, mode == "dynamic", without=tuple(options["without"]))
                for tokens in options["tokens"]:
                    point = {"tokens": tokens, "hidden": hidden, "quant": quant, "dynamic": variants.dynamic}
                    budget = options["time_budget_s"]
                    if budget is not None and time.monotonic() - started > budget:
                        skipped.append(point)
                        continue
                    row, inputs = _measured_point(variants, point, device, group_name, options)
                    rows.append(row)
                    measured = True
                    if tokens == 1 and inputs is not None:
                        host_rows.append({"hidden": hidden, "quant": quant, "dynamic": variants.dynamic,
                                          **_host_cost(variants.current, inputs, group_name, options["host_calls"])})
                if variants.backends:
                    fusion.append(variants.summary(hidden))
        if measured:
            parts.append({"hidden": hidden, "parts_us": _fallback_parts_us(hidden, device, group_name, options["host_calls"])})
    return {
        **report_header("fxfuse bench fallback", torch.cuda.get_device_name()),
        "world_size": ctx.world_size,
        "versions": package_versions(("triton", "flashinfer-python")) | {"nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "dtype": "bfloat16",
        "iters": options["iters"],
        "input_sets": options["input_sets"],
        "l2_bytes": options["l2_bytes"],
        "repeats": options["repeats"],
        "time_budget_s": options["time_budget_s"],
        "fxfuse_without": options["without"],
        "native_fallback": native_installed(),
        "fallback_calls": dict(fusion_stats()["fallback"]),
        "rows": rows,
        "fusion": fusion,
        "host_cost": host_rows,
        "op_parts": parts,
        "skipped": skipped,
        "first_call_s": sum(sum(r.get("first_call_s", {}).values()) for r in rows),
        "wall_s": time.monotonic() - started,
    }


def _measured_point(variants: Variants, point: dict, device, group_name: str, options: dict) -> tuple[dict, tuple | None]:
    """(`checked_point`'s row plus the CUDA-graph timings, the point's inputs); a point that raises is a
    row with its `error` (one line; the traceback goes to stderr) and no inputs, and the sweep goes on."""
    try:
        row, inputs = checked_point(variants, point["tokens"], point["hidden"], device, group_name)
        row.update(_time_point(variants.current, inputs, group_name, options))
        return row, inputs
    except Exception as exc:  # noqa: BLE001 - one broken point (a compile, a kernel) must not lose the sweep
        traceback.print_exc()
        message = str(exc).splitlines()[0] if str(exc) else ""
        return {**point, "ok": False, "error": f"{type(exc).__name__}: {message}"[:300]}, None


def l2_cache_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size in bytes (`UNKNOWN_L2_BYTES` where torch does not say)."""
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or UNKNOWN_L2_BYTES)


def input_set_count(inputs, requested: int, iters: int, l2_bytes: int) -> int:
    """How many copies of a point's inputs the captured calls cycle through: `requested` when above 0,
    else enough that the inputs of the calls between two uses of one copy cover twice `l2_bytes` (so a
    call finds none of its inputs left in L2 by an earlier one), at most `iters`, at least 1."""
    if requested > 0:
        return requested
    streamed = sum(t.numel() * t.element_size() for t in inputs[:2])  # input and residual (`block_inputs`)
    return max(1, min(iters, math.ceil(2 * l2_bytes / max(1, streamed))))


def input_copies(inputs: tuple, count: int) -> list[tuple]:
    """`inputs` and `count - 1` copies of it with the streamed tensors (input, residual) cloned and the
    rest (weight, proj, scale) shared."""
    return [inputs] + [tuple(t.clone() for t in inputs[:2]) + tuple(inputs[2:]) for _ in range(count - 1)]


def cycling_call(fn: Callable, input_sets: list[tuple], group_name: str) -> Callable[[], object]:
    """A zero-argument call of `fn` that takes the next of `input_sets` each time (in capture order)."""
    turn = itertools.count()
    return lambda: fn(*input_sets[next(turn) % len(input_sets)], group_name)


def _time_point(variants: dict, inputs, group_name: str, options: dict) -> dict:
    """Medians (and quartiles) of CUDA-graph replays of `iters` calls, variants interleaved per round; the
    calls cycle through `input_set_count` copies of the inputs (`input_copies`)."""
    count = input_set_count(inputs, options["input_sets"], options["iters"], options["l2_bytes"])
    input_sets = input_copies(inputs, count)
    timings = replay_timings({name: cycling_call(fn, input_sets, group_name) for name, fn in variants.items()},
                             options["repeats"], options["iters"])
    out = {"input_sets": count}
    for name, (median, q1, q3) in timings.items():
        out.update({f"{FIELD[name]}_us": median, f"{FIELD[name]}_p25": q1, f"{FIELD[name]}_p75": q3})
    out["ratio"] = out["fused_us"] / out["inductor_us"]
    return out


def _host_cost(variants: dict, inputs, group_name: str, calls: int) -> dict:
    """Wall microseconds per uncaptured call of both compiled blocks, `calls` back to back (the GPU work
    is tiny at 1 token); medians (and quartiles) over interleaved rounds, so that a slow spell of the
    host hits both alike."""
    blocks = interleaved_wall_us({name: (lambda fn=fn: fn(*inputs, group_name)) for name, fn in variants.items()}, calls)
    out = {}
    for name, (median, q1, q3) in blocks.items():
        out.update({f"{FIELD[name]}_host_us": median, f"{FIELD[name]}_host_p25": q1, f"{FIELD[name]}_host_p75": q3})
    out["ratio"] = out["fused_host_us"] / out["inductor_host_us"]
    return out


def _fallback_parts_us(hidden: int, device, group_name: str, calls: int) -> dict:
    """Host cost (median us) of what one fallback call does at 1 token, piece by piece, called eagerly:
    the all-reduce + wait it issues, its add-RMSNorm kernel launch, the whole op through the dispatcher
    (its C++ kernel where that is installed), and the op's Python kernel (`..._planned`, what runs
    without the C++ one); and tier (b)'s all-reduce-only op as Inductor's code calls it (`all_reduce_`, in
    place), the call that takes the place of Inductor's `allreduce_wait`."""
    from fxfuse.op.kernels.add_rmsnorm_kernel import add_rmsnorm_into
    from fxfuse.op.schema import allreduce_residual_rmsnorm_donate_x

    python_kernel = torch.ops.fxfuse.allreduce_residual_rmsnorm_planned.default
    norm_op = torch.ops.fxfuse.add_rmsnorm_into.default  # the norm launch as the C++ fallback makes it without its own launch
    _, residual, weight, _ = block_inputs("none", 1, hidden, device)
    buffer, out_a, out_b = residual.clone(), torch.empty_like(residual), torch.empty_like(residual)
    all_reduce_, wait = torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.wait_tensor.default
    timings = interleaved_wall_us({
        "allreduce_wait": lambda: wait(all_reduce_(buffer, "sum", group_name)),
        "empty_like_x2": lambda: (torch.empty_like(buffer), torch.empty_like(buffer)),
        "norm_kernel": lambda: add_rmsnorm_into(buffer, residual, weight, EPS, out_a, out_b),
        "norm_op": lambda: norm_op(buffer, residual, weight, EPS, out_a, out_b),
        "op_eager": lambda: allreduce_residual_rmsnorm_donate_x(buffer, residual, weight, EPS, group_name),
        "op_python_kernel": lambda: python_kernel(buffer, residual, weight, EPS, group_name, True),
        "all_reduce_op": lambda: torch.ops.fxfuse.all_reduce_.default(buffer, group_name),
    }, calls)
    return {name: median for name, (median, _, _) in timings.items()}


if __name__ == "__main__":
    raise SystemExit(main())
