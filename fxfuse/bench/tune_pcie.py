"""`fxfuse tune pcie`: measure FlashInfer's PCIe all-reduce on this machine once (with --one-kernel: one kernel vs two).

With `--one-kernel` it also times fxfuse's one-kernel PCIe path against the two-kernel path per token count and
writes which is faster.

Without tuning, FlashInfer's PCIe IPC all-reduce runs a seed configuration that is workable rather
than fast (and warns). This command builds the same workspace `fxfuse.prepare` builds for a job
(world size, hidden size, dtype and `--max-tokens`: FlashInfer keys its tuning by the workspace's
size, so tune with the token count your job prepares, e.g. batch x the widest CUDA-graph width), runs
FlashInfer's collective `tune()` on one GPU per rank (NCCL), and writes the measurements to the
tuning file (`--out`, else $FXFUSE_PCIE_TUNE_CACHE, else FlashInfer's default path). Every later
process that points FXFUSE_PCIE_TUNE_CACHE at that file (the same file on every rank: fxfuse checks
its checksum across ranks) runs the measured configurations. FlashInfer recommends stable GPU
clocks while tuning; fxfuse never changes them.

With `--one-kernel`, it then times, with the tuned configurations, the fused op's two PCIe implementations side by side on the
job's shape (hidden size, dtype, a residual), in CUDA graphs, per token bucket (1, 2, 4, ... up to
`--max-tokens` and the one-kernel workspace's 256): the two-kernel path (FlashInfer's all-reduce, then
fxfuse's add-RMSNorm kernel) and the one kernel (all-reduce + add-RMSNorm in one launch). Each bucket's time
is the slowest rank's median. It writes a thresholds entry (`--thresholds-out`, else $FXFUSE_THRESHOLDS, else
fxfuse-thresholds-pcie-ws<N>.json beside the tuning file) that gives each token count the faster path (the
one kernel only where it was faster; above the last bucket, the two-kernel path, as without the file), and
prints the table. Point FXFUSE_THRESHOLDS at that file on every rank of the job to use it; without it, the
two-kernel path runs, as before. Its GPU tests (tests/gpu/test_one_kernel_pcie_gpu.py and the compiled model
at tp 8 and 2 with it forced) pass with ranks sharing one GPU, which proves it exact, never fast: no PCIe
machine has timed it yet, so it runs only where this comparison, on the user's own machine, found it faster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fxfuse.command_line import CommandParser, add_dtype_option, at_least


def add_tune_pcie_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse tune pcie` (no torch imported)."""
    p.add_argument("--world-size", type=at_least(2), default=None, help="ranks, one GPU each (default: all visible GPUs)")
    p.add_argument("--hidden", type=at_least(8), default=7168, help="hidden size of the model (default 7168: DeepSeek-V3, Kimi-K2)")
    p.add_argument("--max-tokens", type=at_least(1), default=512,
                   help="token capacity the job's fxfuse.prepare asks for (default 512)")
    add_dtype_option(p, ("bfloat16", "float16"), "bfloat16", "activations (default bfloat16)")
    p.add_argument("--out", default=None, help="tuning file to write (default: $FXFUSE_PCIE_TUNE_CACHE, else FlashInfer's path)")
    p.add_argument("--one-kernel", action="store_true",
                   help="also time fxfuse's one-kernel PCIe path against the two-kernel path per token bucket and write "
                        "a thresholds file choosing the faster for each (default off: the two-kernel path everywhere)")
    p.add_argument("--thresholds-out", default=None,
                   help="thresholds file the one-kernel vs two-kernel timings are written to, merged into it if it exists "
                        "(default: $FXFUSE_THRESHOLDS, else fxfuse-thresholds-pcie-ws<N>.json beside the tuning file)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse `fxfuse tune pcie` arguments (a usage error exits with status 2)."""
    p = CommandParser(prog="fxfuse tune pcie", description=__doc__.splitlines()[0])
    add_tune_pcie_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Tune on `--world-size` GPUs and print what was measured; returns the exit status."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    if args.thresholds_out and not args.one_kernel:
        print("fxfuse: error: --thresholds-out is where --one-kernel writes its timings: give --one-kernel too",
              file=sys.stderr)
        return 2
    import torch

    from fxfuse.op.decide.environment import env_setting
    from fxfuse.op.decide.flashinfer_version import installed_features
    from fxfuse.op.decide.thresholds import ENV_THRESHOLDS
    from fxfuse.runner.launch import run_on_ranks

    features = installed_features()
    if not features.pcie:
        print(f"fxfuse: error: tuning the PCIe all-reduce needs flashinfer-python >= 0.7.2 ({features.why_not or features.version})",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_size = args.world_size or gpus
    if world_size not in (2, 4, 8) or world_size > gpus:
        print(f"fxfuse: error: --world-size must be 2, 4 or 8 GPUs and at most the {gpus} present (got {world_size})",
              file=sys.stderr)
        return 2
    if args.hidden % 8:
        print(f"fxfuse: error: --hidden must be a multiple of 8 (16-byte rows; got {args.hidden})", file=sys.stderr)
        return 2
    path, tuned, timings = run_on_ranks(tune_rank, world_size, args.hidden, args.max_tokens, args.dtype, args.out,
                                        args.one_kernel, device="cuda", timeout_s=3600)[0]
    print(f"tuned {len(tuned)} shapes of hidden {args.hidden} at {world_size} ranks; wrote {path}")
    print(f"use it in every rank of the job: FXFUSE_PCIE_TUNE_CACHE={path}")
    if not args.one_kernel:
        return 0
    thresholds_path = args.thresholds_out or env_setting(ENV_THRESHOLDS) or str(
        Path(path).parent / f"fxfuse-thresholds-pcie-ws{world_size}.json")
    entry = write_thresholds(thresholds_path, torch.cuda.get_device_name(), world_size, args.hidden, args.dtype, timings)
    print(timings_table(timings))
    print(f"wrote {thresholds_path}: {describe_ranges(entry)}")
    print(f"use it in every rank of the job: FXFUSE_THRESHOLDS={thresholds_path}")
    return 0


def tune_rank(ctx, hidden: int, max_tokens: int, dtype_name: str, out: str | None, one_kernel: bool = False):
    """One rank's part: build the job's workspace, tune it (collective), then with `one_kernel` time both PCIe
    paths with the tuned configurations (collective); return (path, measured shapes, {tokens: (two-kernel us,
    one-kernel us)} or None)."""
    import torch

    from fxfuse.op.decide.settings import current_settings
    from fxfuse.op.runtime.pcie_kernels import PcieAllReduceKernels

    settings = current_settings()
    path = out or settings.pcie_tune_cache
    if path is None:
        from flashinfer.comm.pcie_ipc_tuning import default_cache_path

        path = default_cache_path(ctx.world_size)
    kernels = PcieAllReduceKernels()
    workspace = kernels.create_workspace(ctx.group, max_tokens, hidden, getattr(torch, dtype_name), settings.pcie_profile, path)
    try:
        tuned = kernels.tune(workspace, path)
    finally:
        kernels.destroy_workspace(workspace, ctx.group)
    timings = None
    if one_kernel:
        from fxfuse.bench.compare_pcie_paths import compare_pcie_paths

        timings = compare_pcie_paths(ctx.group, hidden, getattr(torch, dtype_name), max_tokens, settings.pcie_profile, path)
    return path, sorted(str(key) for key in tuned), timings


def tuned_ranges(timings: dict[int, tuple[float, float]]) -> tuple:
    """Token ranges from per-bucket (two-kernel us, one-kernel us): each bucket's count and those below it down to
    the previous bucket run the faster path, neighbours with the same path merged; above the last bucket, the
    two-kernel path (as without a thresholds file)."""
    from fxfuse.op.decide.modes import FusionMode
    from fxfuse.op.decide.settings import MAX_WORKSPACE_TOKENS
    from fxfuse.op.decide.thresholds import TokenRange

    ranges: list = []
    for tokens in sorted(timings):
        two_kernel_us, one_kernel_us = timings[tokens]
        mode = FusionMode.PCIE_ONE_KERNEL if one_kernel_us < two_kernel_us else FusionMode.PCIE
        if ranges and ranges[-1].mode is mode:
            ranges[-1] = TokenRange(tokens, mode)
        else:
            ranges.append(TokenRange(tokens, mode))
    if ranges and ranges[-1].mode is FusionMode.PCIE:
        ranges[-1] = TokenRange(MAX_WORKSPACE_TOKENS, FusionMode.PCIE)
    else:
        ranges.append(TokenRange(MAX_WORKSPACE_TOKENS, FusionMode.PCIE))
    return tuple(ranges)


def write_thresholds(path: str, gpu: str, world_size: int, hidden: int, dtype_name: str, timings: dict):
    """Merge the entry of these timings (topology pcie) into the thresholds file at `path` (made if absent);
    returns the entry."""
    import datetime

    from fxfuse.op.decide.thresholds import (
        ThresholdEntry,
        ThresholdTable,
        read_table,
        write_table,
    )

    entry = ThresholdEntry(gpu, world_size, hidden, dtype_name, tuned_ranges(timings),
                           f"fxfuse tune pcie, {datetime.date.today().isoformat()}", "pcie")
    table = read_table(path) if Path(path).exists() else ThresholdTable()
    write_table(table.merged(ThresholdTable({entry.key(): entry})), path,
                "fxfuse tune pcie: the one-kernel PCIe path where it was measured faster than the two-kernel path")
    return entry


def timings_table(timings: dict) -> str:
    """The per-bucket timings as a Markdown table (the slowest rank's medians)."""
    lines = ["| tokens | two kernels (us) | one kernel (us) | one / two |", "|---|---|---|---|"]
    lines += [f"| {t} | {two:.1f} | {one:.1f} | {one / two:.2f} |" for t, (two, one) in sorted(timings.items())]
    return "\n".join(lines)


def describe_ranges(entry) -> str:
    """The entry's ranges in words: "1-16 tokens: pcie_one_kernel; 17-524288 tokens: pcie"."""
    return "; ".join(f"{first}-{last} tokens: {mode.value}" for first, last, mode in entry.spans())
