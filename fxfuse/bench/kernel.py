"""`fxfuse bench kernel`: the fused all-reduce + residual + RMSNorm op against unfused, per token count.

Variants (each checked against an fp32 reference, then timed by CUDA-graph replay):
  fused-oneshot / fused-twoshot   FlashInfer's TensorRT-LLM kernel, as the fused op runs it
  pcie                            FlashInfer's PCIe IPC all-reduce + the fused add-RMSNorm kernel (>= 0.7.2)
  pcie-one-kernel                 fxfuse's one-kernel all-reduce + add-RMSNorm over CUDA IPC (up to 256 tokens)
  fallback                        the fused op's NCCL path: all-reduce + the fused add-RMSNorm kernel
  nccl+inductor                   unfused: NCCL all-reduce, then add + RMSNorm compiled by Inductor
Defaults: tokens 1, 2, 4, ..., 2048; hidden 7168 and 4096; bf16. A timing is the median over
replays of a graph of --graph-iters calls, in microseconds per call, on the slowest rank.

Launch with `torchrun --nproc-per-node N -m fxfuse.bench.kernel`, or `fxfuse bench kernel
--world-size N`, which spawns N ranks over the visible GPUs. With fewer GPUs than ranks the
ranks share GPUs over gloo: NCCL cannot do that, so the unfused variants run eagerly with a gloo
all-reduce and are only checked, and the fused timings are labelled not meaningful (the GPU
time-slices the ranks). Results go to --out-dir (JSON, markdown, PNG); --write-thresholds also
writes a thresholds table derived from the medians, keyed by the GPU and the group's topology
(refused when timings are not meaningful).
Exit status 1 if any check exceeds the error tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import statistics
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fxfuse.bench.arguments import KERNEL_DESCRIPTION, add_kernel_arguments, check_kernel_arguments
from fxfuse.bench.kernel_report import FUSED_MODES, VARIANTS, derive_thresholds, markdown, write_report
from fxfuse.bench.output import package_versions, publish, relative_l2_error, report_header
from fxfuse.command_line import CommandParser, check_output_dir, check_output_file, parsed_or_status
from fxfuse.op.decide.modes import FusionMode
from fxfuse.runner.launch import run_on_ranks
from fxfuse.runner.torchrun import launched_world_size

EPS = 1e-6
TOLERANCE = 2e-2  # relative L2 error vs fp32; bf16 rounding alone gives about 3e-3


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures (identical on all ranks)."""

    tokens: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    dtype: str
    repeats: int
    graph_iters: int
    variants: tuple[str, ...]
    seed: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse `fxfuse bench kernel` arguments (a usage error exits with status 2)."""
    p = CommandParser(prog="fxfuse bench kernel", description=KERNEL_DESCRIPTION)
    add_kernel_arguments(p)
    args = p.parse_args(argv)
    check_kernel_arguments(p, args)
    return args


def _checked_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, with the output paths checked (ValueError naming a bad one)."""
    args = parse_args(argv)
    check_output_dir(args.out_dir, "--out-dir")
    if args.write_thresholds:
        check_output_file(args.write_thresholds, "--write-thresholds")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (spawning ranks or joining torchrun), write the reports, return the exit status."""
    args, status = parsed_or_status(lambda: _checked_args(argv))
    if status is not None:
        return status
    if not torch.cuda.is_available():
        print("fxfuse: error: fxfuse bench kernel needs CUDA GPUs (this machine has none)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    world_size = launched_world_size() or args.world_size or max(gpus, 2)
    share_gpus = world_size > gpus
    config = BenchConfig(
        tokens=tuple(int(t) for t in args.tokens.split(",")),
        hidden_sizes=tuple(int(h) for h in args.hidden.split(",")),
        dtype=args.dtype,
        repeats=args.repeats or (5 if share_gpus else 50),
        graph_iters=args.graph_iters,
        variants=tuple(v for v in VARIANTS if v in args.variants.split(",")),
    )
    results = run_on_ranks(bench_rank, world_size, config, device="cpu" if share_gpus else "cuda")
    report = results[0]
    if report is None:  # a non-zero torchrun rank: rank 0 reports
        return 0
    try:
        publish(report, "kernel", argv, lambda r: write_report(r, args.out_dir), markdown)
        if args.write_thresholds:
            _write_thresholds(report, args.write_thresholds)
    except OSError as exc:  # the measurement is not lost: print it, then the error
        print(markdown(report))
        print(f"fxfuse: error: cannot write the results: {exc}", file=sys.stderr)
        return 2
    if report["max_rel_err"] > TOLERANCE:
        print(f"FAILED: relative error {report['max_rel_err']:.2e} above {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    return 0


def _write_thresholds(report: dict, path: Path) -> None:
    from fxfuse.op.decide.thresholds import ThresholdTable, read_table, write_table

    try:
        derived = derive_thresholds(report)
    except ValueError as exc:
        print(f"no thresholds written: {exc}", file=sys.stderr)
        return
    table = read_table(path) if path.exists() else ThresholdTable()
    write_table(table.merged(derived), path, "written by fxfuse bench kernel --write-thresholds")
    print(f"wrote thresholds for {len(derived.entries)} hidden size(s) to {path}")


def bench_rank(ctx, config: BenchConfig) -> dict | None:
    """One rank's part: measure every (hidden, tokens, variant); rank 0 returns the report."""
    from fxfuse.op.decide.group_config import config_of
    from fxfuse.op.runtime import prepare as op_prepare

    share_gpus = "gloo" in str(dist.get_backend(ctx.group))
    if share_gpus:
        torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    dtype = getattr(torch, config.dtype)
    bench = _RankBench(ctx, config, dtype, share_gpus)
    rows = []
    for hidden in config.hidden_sizes:
        op_prepare.prepare(ctx.group, hidden, dtype, max(config.tokens))
        bench.plans = {}
        for tokens in config.tokens:
            rows += bench.measure_point(hidden, tokens)
    op_prepare.destroy_workspaces(ctx.group, graphs_released=True)  # every timing graph was deleted
    if ctx.rank != 0:
        return None
    topology = config_of(ctx.group).topology.value
    return _report(config, ctx.world_size, share_gpus, rows, op_prepare.fusion_stats(), topology)


@dataclass(frozen=True)
class _Runs:
    """A variant's correctness call (fresh inputs) and its timed call (None: not timed)."""

    check: Callable
    timed: Callable | None = None


class _RankBench:
    """Inputs, reference, variant callables and timing for one rank."""

    def __init__(self, ctx, config: BenchConfig, dtype: torch.dtype, share_gpus: bool):
        self.ctx, self.config, self.dtype, self.share_gpus = ctx, config, dtype, share_gpus
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.compiled_add_rmsnorm: tuple[int, Callable] | None = None
        self.plans: dict = {}  # variant -> the fused op's plan for it at the current hidden size (None: cannot run)

    def measure_point(self, hidden: int, tokens: int) -> list[dict]:
        """Check and time every variant at one (hidden, tokens); rows identical on all ranks."""
        inputs = self._inputs(hidden, tokens)
        reference = _fp32_reference(*inputs)
        rows = []
        for variant in self.config.variants:
            row = {"hidden": hidden, "tokens": tokens, "variant": variant, "status": "ok",
                   "median_us": None, "rel_err_normed": 0.0, "rel_err_residual": 0.0, "note": ""}
            runs = self._variant(variant, inputs)
            if isinstance(runs, str):
                row.update(status="n/a", note=runs)
                rows.append(row)
                continue
            normed, residual_out = runs.check()
            err_n, err_r = relative_l2_error(normed, reference[0]), relative_l2_error(residual_out, reference[1])
            median = self._time(runs.timed) if runs.timed is not None else -1.0
            worst = self._max_over_ranks([err_n, err_r, median])
            row.update(rel_err_normed=worst[0], rel_err_residual=worst[1],
                       median_us=worst[2] if worst[2] >= 0 else None,
                       status="ok" if max(worst[:2]) <= TOLERANCE else "failed")
            if runs.timed is None:
                row["note"] = "checked only: NCCL cannot run ranks that share a GPU, nor gloo a CUDA graph"
            rows.append(row)
        return rows

    def _inputs(self, hidden: int, tokens: int):
        """(this rank's x, every rank's x, residual, weight): deterministic, same on every rank."""
        def randn(*shape, salt):
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.config.seed, hidden, tokens, salt)).encode()))
            return torch.randn(*shape, generator=g).to(self.device, self.dtype)

        xs = [randn(tokens, hidden, salt=r) for r in range(self.ctx.world_size)]
        residual = randn(tokens, hidden, salt="residual")
        weight = (1 + 0.1 * randn(hidden, salt="weight").float()).to(self.dtype)
        return xs[self.ctx.rank].clone(), xs, residual, weight

    def _variant(self, variant: str, inputs) -> "_Runs | str":
        """How to check and time one variant on static inputs, or why it cannot run here."""
        x, _, residual, weight = inputs
        if variant in FUSED_MODES:
            return self._fused_runs(variant, x, residual, weight)
        add_norm = self._inductor_add_rmsnorm(x.shape[1])
        group = self.ctx.group
        if self.share_gpus:
            return _Runs(check=lambda: add_norm(_gloo_all_reduce(x.clone(), group), residual.clone(), weight))

        def check():
            reduced = x.clone()
            dist.all_reduce(reduced, group=group)
            return add_norm(reduced, residual.clone(), weight)

        work_x, work_residual = x.clone(), residual.clone()

        def timed():  # in place on static buffers, as a model reduces its matmul output
            dist.all_reduce(work_x, group=group)
            return add_norm(work_x, work_residual, weight)
        return _Runs(check, timed)

    def _fused_runs(self, variant, x, residual, weight) -> "_Runs | str":
        from fxfuse.op.decide.policy import FusionProblem, feasible_trtllm_modes
        from fxfuse.op.runtime.prepare import forced_plan

        mode = FUSED_MODES[variant]
        tokens, hidden = x.shape
        if mode.trtllm:
            problem = FusionProblem(0, self.ctx.world_size, x.dtype, hidden, tokens, x.dtype, x.dtype, None, None,
                                    trtllm_max_tokens=tokens)
            if mode not in feasible_trtllm_modes(problem):
                return f"{mode.value} cannot run {tokens} tokens on {self.ctx.world_size} ranks"
        if mode.trtllm or mode in (FusionMode.PCIE, FusionMode.PCIE_ONE_KERNEL):
            kind = "trtllm" if mode.trtllm else mode.value
            if kind not in self.plans:  # one workspace per kind and hidden size, made collectively
                self.plans[kind] = forced_plan(self.ctx.group, mode, hidden, x.dtype, max(self.config.tokens))
            if self.plans[kind] is None:
                return f"{variant} workspace unavailable (see the log)"
            plan = self.plans[kind]
            if tokens > plan.workspace.max_tokens:
                return f"{variant} holds at most {plan.workspace.max_tokens} tokens"
            decision = dataclasses.replace(plan.decision, mode=mode)
            plan = dataclasses.replace(plan, decision=decision)
        else:
            plan = forced_plan(self.ctx.group, mode, hidden, x.dtype, max(self.config.tokens))
            if self.share_gpus:  # gloo: checked eagerly, a CUDA graph cannot capture it
                return _Runs(check=lambda: plan(x, residual, weight, EPS, False))
        return _Runs(lambda: plan(x, residual, weight, EPS, False), lambda: plan(x, residual, weight, EPS, False))

    def _inductor_add_rmsnorm(self, hidden: int) -> Callable:
        """add_rmsnorm compiled by Inductor, recompiled per hidden size (token count dynamic)."""
        if self.compiled_add_rmsnorm is None or self.compiled_add_rmsnorm[0] != hidden:
            torch._dynamo.reset()  # fresh automatic-dynamic state, so only the token count turns dynamic
            self.compiled_add_rmsnorm = (hidden, torch.compile(add_rmsnorm))
        return self.compiled_add_rmsnorm[1]

    def _time(self, call: Callable) -> float:
        """Median µs per call over CUDA-graph replays of graph_iters calls."""
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.config.graph_iters):
                call()
        graph.replay()
        torch.cuda.synchronize()
        dist.barrier(group=self.ctx.group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.config.repeats):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000 / self.config.graph_iters)
        del graph
        return statistics.median(samples)

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        from fxfuse.op.decide.agreement import collective_device

        t = torch.tensor(values, dtype=torch.float64, device=collective_device(self.ctx.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.group)
        return t.tolist()


def add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS):
    """Unfused reference math (as transformers writes RMSNorm): (weight * rmsnorm(y + residual), y + residual)."""
    residual_out = y + residual
    h = residual_out.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(y.dtype), residual_out


def _gloo_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    host = x.cpu()
    dist.all_reduce(host, group=group)
    return host.to(x.device)


def _fp32_reference(x, xs, residual, weight):
    residual_out = torch.stack([t.float() for t in xs]).sum(0) + residual.float()
    normed = residual_out * torch.rsqrt(residual_out.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return normed, residual_out


def _versions() -> dict[str, str]:
    versions = package_versions(("flashinfer-python", "apache-tvm-ffi"))
    try:
        versions["fxfuse"] = importlib.metadata.version("fxfuse")
    except importlib.metadata.PackageNotFoundError:
        from fxfuse import __version__

        versions["fxfuse"] = f"{__version__} (source tree)"
    if dist.is_nccl_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def _report(config: BenchConfig, world_size: int, share_gpus: bool, rows: list[dict], stats: dict, topology: str) -> dict:
    checked = [max(r["rel_err_normed"], r["rel_err_residual"]) for r in rows if r["status"] != "n/a"]
    return {
        **report_header("fxfuse bench kernel", torch.cuda.get_device_name()),
        "world_size": world_size,
        "topology": topology,
        "ranks_share_gpu": share_gpus,
        "timings_meaningful": not share_gpus,
        "timing_note": (f"{world_size} ranks time-slice {torch.cuda.device_count()} GPU(s); "
                        "run for correctness only") if share_gpus else "",
        "versions": _versions(),
        "dtype": config.dtype,
        "tokens": list(config.tokens),
        "hidden_sizes": list(config.hidden_sizes),
        "graph_iters": config.graph_iters,
        "repeats": config.repeats,
        "tolerance": TOLERANCE,
        "max_rel_err": max(checked, default=0.0),
        "fused_calls_rank0": {" ".join(map(str, k)): n for k, n in stats["fused"].items()},
        "fallback_calls_rank0": stats["fallback"],
        "results": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
