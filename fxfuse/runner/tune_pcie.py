"""`fxfuse tune pcie`: measure FlashInfer's PCIe all-reduce launch configurations on this machine, once.

Without tuning, FlashInfer's PCIe IPC all-reduce runs a seed configuration that is workable rather
than fast (and warns). This command builds the same workspace `fxfuse.prepare` builds for a job
(world size, hidden size, dtype and `--max-tokens`: FlashInfer keys its tuning by the workspace's
size, so tune with the token count your job prepares, e.g. batch x the widest CUDA-graph width), runs
FlashInfer's collective `tune()` on one GPU per rank (NCCL), and writes the measurements to the
tuning file (`--out`, else $FXFUSE_PCIE_TUNE_CACHE, else FlashInfer's default path). Every later
process that points FXFUSE_PCIE_TUNE_CACHE at that file (the same file on every rank: fxfuse checks
its checksum across ranks) runs the measured configurations. FlashInfer recommends stable GPU
clocks while tuning; fxfuse never changes them.
"""

from __future__ import annotations

import argparse
import sys

from fxfuse.command_line import CommandParser, add_dtype_option, at_least


def add_tune_pcie_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse tune pcie` (no torch imported)."""
    p.add_argument("--world-size", type=at_least(2), default=None, help="ranks, one GPU each (default: all visible GPUs)")
    p.add_argument("--hidden", type=at_least(8), default=7168, help="hidden size of the model (default 7168: DeepSeek-V3, Kimi-K2)")
    p.add_argument("--max-tokens", type=at_least(1), default=512,
                   help="token capacity the job's fxfuse.prepare asks for (default 512)")
    add_dtype_option(p, ("bfloat16", "float16"), "bfloat16", "activations (default bfloat16)")
    p.add_argument("--out", default=None, help="tuning file to write (default: $FXFUSE_PCIE_TUNE_CACHE, else FlashInfer's path)")


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
    import torch

    from fxfuse.op.decide.flashinfer_version import installed_features
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
    path, tuned = run_on_ranks(tune_rank, world_size, args.hidden, args.max_tokens, args.dtype, args.out,
                               device="cuda", timeout_s=3600)[0]
    print(f"tuned {len(tuned)} shapes of hidden {args.hidden} at {world_size} ranks; wrote {path}")
    print(f"use it in every rank of the job: FXFUSE_PCIE_TUNE_CACHE={path}")
    return 0


def tune_rank(ctx, hidden: int, max_tokens: int, dtype_name: str, out: str | None):
    """One rank's part: build the job's workspace, tune it (collective), return (path, measured shapes)."""
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
    return path, sorted(str(key) for key in tuned)
