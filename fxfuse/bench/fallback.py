"""`fxfuse bench fallback`: the fused op's NCCL fallback against the unfused graph Inductor compiles, on one GPU.

Where no fused all-reduce runs (a one-rank NCCL group here, tokens above a workspace, a machine
without one), the fused op must cost no more than what it replaced. This benchmark compiles the same
block twice, `x = 2 * input` (a producer whose output is dead after the all-reduce, as a matmul's
is), `funcol.all_reduce(x) + residual`, then a transformers-style RMSNorm, bf16:
- `inductor`: `torch.compile(backend="inductor")`: NCCL all-reduce re-inplaced into x, then
  Inductor's own add-RMSNorm kernel;
- `fallback`: `torch.compile(backend=FxfuseBackend(fuse_without_fast_kernel=True))`: the same
  graph with the site fused, so the fused op runs its NCCL plan (all-reduce in the donated x, then
  the fused add-RMSNorm kernel).
Both are captured in CUDA graphs of `--iters` calls and replayed in interleaved rounds; each point
reports the median (and p25/p75) over `--repeats` samples in microseconds per call, and the ratio
fallback / inductor. It also measures the host cost per call outside CUDA graphs (wall time of
`--host-calls` back-to-back uncaptured calls at 1 token, where the GPU work is smallest) and checks
both variants against an fp32 reference. One process, one GPU, NCCL with one rank: the numbers say
what the fallback costs, not what fusing saves (that needs two or more GPUs).

Writes bench/results/fallback_<gpu>_<stamp>.json (fields gpu, world_size, versions, date, command,
fallback_vs_inductor: [{tokens, hidden, fallback_us, inductor_us, ratio, ...}], host_cost) and .md.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed._functional_collectives as funcol

from fxfuse.bench.arguments import FALLBACK_DESCRIPTION, add_fallback_arguments
from fxfuse.bench.output import gpu_slug, header_lines, one_gpu_arguments, report_header, package_versions, publish, relative_l2_error, write_result_files
from fxfuse.bench.replay import interleaved_wall_us, replay_timings
from fxfuse.runner.launch import run_on_ranks

EPS = 1e-6
TOLERANCE = 2e-2  # relative L2 error vs fp32; bf16 rounding alone gives about 3e-3


def block(inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, group_name: str):
    """Producer, all-reduce, residual add, RMSNorm (float32 upcast, weight after the cast back)."""
    x = inp * 2
    hidden = funcol.all_reduce(x, "sum", group_name) + residual
    h = hidden.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(hidden.dtype)
    return weight * normed, hidden


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on one GPU, write its files, return the exit status."""
    args, status = one_gpu_arguments(argv, "fxfuse bench fallback", FALLBACK_DESCRIPTION, add_fallback_arguments)
    if status is not None:
        return status
    options = {"tokens": args.tokens, "hidden": args.hidden, "repeats": args.repeats, "iters": args.iters,
               "host_calls": args.host_calls}
    report = run_on_ranks(bench_rank, 1, options, device="cuda", timeout_s=1800)[0]
    publish(report, "fallback", argv, lambda r: write_result_files(
        args.out_dir / file_stem(r), r, markdown(r), lambda path: False), markdown)
    if report["max_rel_err"] > TOLERANCE:
        print(f"FAILED: relative error {report['max_rel_err']:.2e} above {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    return 0


def file_stem(report: dict) -> str:
    """fallback_<gpu>_<stamp>."""
    return f"fallback_{gpu_slug(report['gpu'])}_{report['stamp']}"


@torch.no_grad()
def bench_rank(ctx, options: dict) -> dict:
    """Compile both variants per hidden size, check them, and time every token count."""
    import fxfuse
    from fxfuse.backend import FxfuseBackend
    from fxfuse.op.cuda_dispatch import fusion_stats
    from fxfuse.op.native_fallback import native_installed

    device = torch.device("cuda", torch.cuda.current_device())
    group_name = ctx.group.group_name
    rows, host_rows, errors = [], [], []
    for hidden in options["hidden"]:
        fxfuse.prepare(ctx.group, hidden, torch.bfloat16, max(options["tokens"]))
        backend = FxfuseBackend(fuse_without_fast_kernel=True)
        torch._dynamo.reset()
        variants = {
            "inductor": torch.compile(block, backend="inductor", fullgraph=True, dynamic=True),
            "fallback": torch.compile(block, backend=backend, fullgraph=True, dynamic=True),
        }
        for tokens in options["tokens"]:
            inputs = _inputs(tokens, hidden, device)
            reference = _fp32_reference(*inputs)
            for name, fn in variants.items():
                out = fn(*inputs, group_name)
                errors.append(max(relative_l2_error(o, r) for o, r in zip(out, reference)))
            if backend.records[-1].stats.fused != 1:
                raise RuntimeError(f"the fxfuse variant did not fuse its site: {backend.records[-1].stats}")
            rows.append({"tokens": tokens, "hidden": hidden, **_time_point(variants, inputs, group_name, options)})
            if tokens == 1:
                host_rows.append({"tokens": 1, "hidden": hidden, **_host_cost(variants, inputs, group_name, options["host_calls"])})
    return {
        **report_header("fxfuse bench fallback", torch.cuda.get_device_name()),
        "world_size": ctx.world_size,
        "versions": package_versions(("triton", "flashinfer-python")) | {"nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "dtype": "bfloat16",
        "iters": options["iters"],
        "repeats": options["repeats"],
        "max_rel_err": max(errors),
        "native_fallback": native_installed(),
        "fallback_calls": {k: v for k, v in fusion_stats()["fallback"].items()},
        "fallback_vs_inductor": rows,
        "host_cost": host_rows,
    }


def _inputs(tokens: int, hidden: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(tokens * 7 + hidden)
    inp = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    residual = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16)
    return inp, residual, weight


def _fp32_reference(inp, residual, weight):
    hidden = 2 * inp.float() + residual.float()
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS) * weight.float(), hidden


def _time_point(variants: dict, inputs, group_name: str, options: dict) -> dict:
    """Medians (and quartiles) of CUDA-graph replays of `iters` calls, variants interleaved per round."""
    timings = replay_timings({name: (lambda fn=fn: fn(*inputs, group_name)) for name, fn in variants.items()},
                             options["repeats"], options["iters"])
    out = {}
    for name, (median, q1, q3) in timings.items():
        out.update({f"{name}_us": median, f"{name}_p25": q1, f"{name}_p75": q3})
    out["ratio"] = out["fallback_us"] / out["inductor_us"]
    return out


def _host_cost(variants: dict, inputs, group_name: str, calls: int) -> dict:
    """Wall microseconds per uncaptured call, `calls` back to back (the GPU work is tiny at 1 token):
    the two compiled blocks, and the parts of the fused op's fallback called eagerly (`parts_us`);
    medians (and quartiles) over interleaved rounds, so that a slow spell of the host hits all alike."""
    blocks = interleaved_wall_us({name: (lambda fn=fn: fn(*inputs, group_name)) for name, fn in variants.items()}, calls)
    out = {}
    for name, (median, q1, q3) in blocks.items():
        out.update({f"{name}_host_us": median, f"{name}_host_p25": q1, f"{name}_host_p75": q3})
    out["ratio"] = out["fallback_host_us"] / out["inductor_host_us"]
    out["parts_us"] = {name: median for name, (median, _, _) in _fallback_parts_us(inputs, group_name, calls).items()}
    return out


def _fallback_parts_us(inputs, group_name: str, calls: int) -> dict:
    """Host cost of what one fallback call does, piece by piece, called eagerly: the all-reduce + wait
    it issues, its add-RMSNorm kernel launch, the whole op through the dispatcher (its C++ kernel where
    that is installed), and the op's Python kernel (`..._planned`, what runs without the C++ one)."""
    from fxfuse.op.add_rmsnorm_kernel import add_rmsnorm_into
    from fxfuse.op.schema import allreduce_residual_rmsnorm_donate_x

    python_kernel = torch.ops.fxfuse.allreduce_residual_rmsnorm_planned.default
    norm_op = torch.ops.fxfuse.add_rmsnorm_into.default  # the norm launch as the C++ fallback makes it without its own launch
    inp, residual, weight = inputs
    buffer, out_a, out_b = inp.clone(), torch.empty_like(inp), torch.empty_like(inp)
    all_reduce_, wait = torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.wait_tensor.default
    return interleaved_wall_us({
        "allreduce_wait": lambda: wait(all_reduce_(buffer, "sum", group_name)),
        "empty_like_x2": lambda: (torch.empty_like(buffer), torch.empty_like(buffer)),
        "norm_kernel": lambda: add_rmsnorm_into(buffer, residual, weight, EPS, out_a, out_b),
        "norm_op": lambda: norm_op(buffer, residual, weight, EPS, out_a, out_b),
        "op_eager": lambda: allreduce_residual_rmsnorm_donate_x(buffer, residual, weight, EPS, group_name),
        "op_python_kernel": lambda: python_kernel(buffer, residual, weight, EPS, group_name, True),
    }, calls)


def markdown(report: dict) -> str:
    """The report as a markdown table."""
    lines = header_lines(f"fxfuse bench fallback: {report['gpu']}, one-rank NCCL group, {report['dtype']}", report) + [
        f"- timing: CUDA-graph replay of {report['iters']} calls, median (p25-p75) of {report['repeats']} samples, "
        "microseconds per call; variants interleaved",
        f"- correctness: max relative L2 error vs fp32 {report['max_rel_err']:.2e}",
        "",
        "| hidden | tokens | Inductor us | fxfuse fallback us | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in report["fallback_vs_inductor"]:
        lines.append(f"| {r['hidden']} | {r['tokens']} | {r['inductor_us']:.2f} ({r['inductor_p25']:.2f}-{r['inductor_p75']:.2f}) "
                     f"| {r['fallback_us']:.2f} ({r['fallback_p25']:.2f}-{r['fallback_p75']:.2f}) | {r['ratio']:.3f} |")
    lines += ["", f"Host cost per uncaptured call (1 token; the op's C++ fallback {'installed' if report.get('native_fallback') else 'NOT installed'}; "
              "median (p25-p75) of interleaved rounds):", "", "| hidden | Inductor us | fxfuse us | ratio |", "|---:|---:|---:|---:|"]
    for r in report["host_cost"]:
        lines.append(f"| {r['hidden']} | {r['inductor_host_us']:.1f} ({r['inductor_host_p25']:.1f}-{r['inductor_host_p75']:.1f}) "
                     f"| {r['fallback_host_us']:.1f} ({r['fallback_host_p25']:.1f}-{r['fallback_host_p75']:.1f}) | {r['ratio']:.3f} |")
    lines += ["", "Parts of one fallback call, called eagerly (us per call):", ""]
    for r in report["host_cost"]:
        lines.append(f"- hidden {r['hidden']}: " + ", ".join(f"{name} {us:.1f}" for name, us in r["parts_us"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
