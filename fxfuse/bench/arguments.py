"""The options of `fxfuse bench model`, `kernel`, `fallback`, `gemm` and `compile`, with their defaults; imports
no torch.

`add_model_arguments(parser)`, `add_kernel_arguments(parser)`, `add_fallback_arguments(parser)`,
`add_gemm_arguments(parser)` and `add_compile_arguments(parser)` declare each benchmark's options
(the `fxfuse` command and each benchmark's own `python -m` entry share them), so `--help` and
unknown options are answered before torch is imported. Options whose default depends on the machine
(the model benchmark's `--preset`, `--layers`, `--tp`, `--tokens`, `--batch`, `--context`, `--repeats` and
`--iters`: per `--device`) default to None and are resolved by the benchmark; their help says to what.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fxfuse.command_line import WEIGHT_SPELLINGS, add_dtype_option, at_least, comma_subset, int_list, positive_float, spelled
from fxfuse.passes.config import PATTERNS
from fxfuse.runner.options import BACKENDS, DYNAMIC_CHOICES


def _joined(values) -> str:
    return ",".join(map(str, values))


MODEL_DESCRIPTION = ("DeepSeek-V3 verify-step latency, eager vs Inductor vs fxfuse, under CUDA graphs (or uncaptured "
                     "with --no-cuda-graphs).")
KERNEL_DESCRIPTION = "The fused all-reduce + residual + RMSNorm op against unfused, per token count (CUDA)."
GEMM_DESCRIPTION = ("The quantized GEMMs (FP8 block-scaled, INT4 experts) against bf16 at DeepSeek-V3 / Kimi-K2.5 "
                    "shapes, one GPU (CUDA).")
FALLBACK_DESCRIPTION = ("The fused op's NCCL fallback against the unfused graph Inductor compiles, with or without an "
                        "FP8 quantization after the norm, static and dynamic shapes, one GPU, one-rank NCCL group (CUDA).")
COMPILE_DESCRIPTION = ("Cold and warm compile time (a fresh Inductor cache, then a second process on the same cache) "
                       "of a model step with plain Inductor and with fxfuse, on the CPU.")

#: Model benchmark defaults per device (step widths, batch sizes, preset, layers, timing samples and calls
#: per sample), and the KV-cache length. On cpu they make the smoke run of `CPU_SMOKE_RUN`: tp 2, so the
#: all-reduce sites exist and fuse; one width and one batch size, so each compiled backend compiles one graph
#: (Inductor's C++ code generation takes about a minute per graph of the tiny model on 2 cores: 1,4,16,64 x 1,8
#: at tp 1 took 10.6 minutes); the tiny preset's first 2 layers, one dense and one MoE.
DEFAULT_TOKENS = {"cuda": (1, 4, 16, 64), "cpu": (2,)}
DEFAULT_BATCHES = {"cuda": (1, 8), "cpu": (2,)}
DEFAULT_PRESET = {"cuda": "deepseek-v3", "cpu": "tiny"}
DEFAULT_LAYERS = {"cuda": 4, "cpu": 2}
DEFAULT_REPEATS = {"cuda": 10, "cpu": 3}
DEFAULT_ITERS = {"cuda": 5, "cpu": 2}
#: The tensor-parallel size of the cpu smoke run (gloo processes); on cuda the default is every visible GPU.
CPU_TP = 2
DEFAULT_CONTEXT = 1024
CPU_SMOKE_RUN = (
    "--device cpu is a smoke run of the benchmark's code, about a minute on 2 CPU cores (47 to 85 s measured, by "
    f"the machine's load; 20 s once Inductor's cache holds its kernels): the {DEFAULT_PRESET['cpu']} preset's first {DEFAULT_LAYERS['cpu']} layers (one "
    f"dense, one MoE), tensor parallel over {CPU_TP} gloo processes, {_joined(DEFAULT_BATCHES['cpu'])} sequences "
    f"x {_joined(DEFAULT_TOKENS['cpu'])} tokens per step, each backend compiled once (fxfuse: its passes, then "
    f"Inductor) and timed in {DEFAULT_REPEATS['cpu']} samples of {DEFAULT_ITERS['cpu']} calls. What it checks: "
    "each backend's step compiles and runs, its logits stay within the bound of eager's (exit status 1 if not), and "
    "the report files are written; the report says how many all-reduce sites fxfuse fused (all "
    f"{1 + 2 * DEFAULT_LAYERS['cpu']}: the embedding's and two per layer; the fused op runs its CPU reference kernel, "
    "gloo all-reduce + float32 RMSNorm). What it does not measure: speed. Its times are the wall clock of processes sharing the "
    "CPU's cores, with no CUDA graphs, no fused all-reduce kernel and no GPU, so its fxfuse / inductor ratios "
    "and all-reduce shares say nothing about a GPU run."
)
DEFAULT_OUT_DIR = Path("bench/results")
OUT_DIR_HELP = f"where result files go; the files written are listed at the end (default {DEFAULT_OUT_DIR}, in the current directory)"

#: Kernel benchmark defaults: token counts 1 .. 2048 and the hidden sizes of DeepSeek-V3 and Llama-8B.
DEFAULT_KERNEL_TOKENS = tuple(2**i for i in range(12))
DEFAULT_HIDDEN = (7168, 4096)
#: Fallback benchmark defaults: token counts 1 .. 4096; the quantization kinds after the norm
#: (`fxfuse.bench.fallback_blocks`) and the shape modes (static: `dynamic=False`, dynamic: `dynamic=True`).
DEFAULT_FALLBACK_TOKENS = tuple(2**i for i in range(13))
FALLBACK_QUANT = ("none", "group", "row", "tensor", "row_reciprocal", "group_ue8m0", "clamp_scale", "second_rmsnorm")
FALLBACK_MODES = ("static", "dynamic")
#: The per-token-group quantization's group: `--hidden` must be a multiple of it with `--quant group`.
QUANT_GROUP = 128
#: GEMM benchmark defaults: decode, verify and small-prefill token counts; both parts.
DEFAULT_GEMM_TOKENS = (1, 8, 64, 256)
GEMM_PARTS = ("dense", "experts")
#: Compile benchmark: the models (tiny at tp=2, DeepSeek-V3 widths at tp=8), the backends, their defaults.
COMPILE_MODELS = ("tiny", "deepseek-v3")
COMPILE_BACKENDS = ("inductor", "fxfuse")
DEFAULT_COMPILE_LAYERS = 4
DEFAULT_COMPILE_REPEATS = 3
#: The kernel benchmark's variants, in table order (their report titles: `fxfuse.bench.kernel_report.VARIANTS`).
KERNEL_VARIANTS = ("fused-oneshot", "fused-twoshot", "pcie", "pcie-one-kernel", "fallback", "nccl+inductor")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse bench model`; its help ends with what the cpu smoke run does (`CPU_SMOKE_RUN`)."""
    p.epilog = CPU_SMOKE_RUN
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda, or cpu for a smoke run of the code on gloo ranks, which checks the benchmark and "
                        "measures no speed (see below) (default cuda)")
    p.add_argument("--preset", default=None,
                   help=f"model preset (default: {DEFAULT_PRESET['cuda']} at full width on cuda, "
                        f"{DEFAULT_PRESET['cpu']} on cpu, where full-width layers do not fit in memory)")
    p.add_argument("--layers", type=at_least(1), default=None,
                   help=f"decoder layers (default {DEFAULT_LAYERS['cuda']} on cuda: 3 dense + 1 MoE for deepseek-v3; "
                        f"{DEFAULT_LAYERS['cpu']} on cpu: 1 dense + 1 MoE for tiny; all of a preset with fewer)")
    p.add_argument("--tp", type=at_least(1), default=None,
                   help=f"tensor-parallel size (default: all visible GPUs on cuda, {CPU_TP} on cpu; under torchrun its "
                        "WORLD_SIZE, which a given --tp must match)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated step widths, at most 128 (default "
                        f"{_joined(DEFAULT_TOKENS['cuda'])} on cuda, {_joined(DEFAULT_TOKENS['cpu'])} on cpu)")
    p.add_argument("--batch", default=None,
                   help=f"comma-separated batch sizes (default {_joined(DEFAULT_BATCHES['cuda'])} on cuda, "
                        f"{_joined(DEFAULT_BATCHES['cpu'])} on cpu)")
    p.add_argument("--backends", default=_joined(BACKENDS),
                   help=f"comma-separated subset of {', '.join(BACKENDS)} (default: all)")
    add_dtype_option(p, ("bfloat16", "float16", "float32"), "bfloat16", "weights and activations (default bfloat16)")
    p.add_argument("--context", type=at_least(1), default=None,
                   help=f"KV-cache length (positions) every step attends over (default {DEFAULT_CONTEXT}, "
                        "or the preset's max_position_embeddings if smaller)")
    p.add_argument("--repeats", type=at_least(1), default=None,
                   help=f"timing samples per point; the median is reported (default {DEFAULT_REPEATS['cuda']} on cuda, "
                        f"{DEFAULT_REPEATS['cpu']} on cpu)")
    p.add_argument("--iters", type=at_least(1), default=None,
                   help=f"replays per timing sample, or calls where nothing is captured (default {DEFAULT_ITERS['cuda']} on cuda, "
                        f"{DEFAULT_ITERS['cpu']} on cpu)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop capturing new points after this many seconds and report what was measured "
                        "(default: no budget)")
    p.add_argument("--single-rank-collectives", action="store_true",
                   help="at --tp 1, still issue every all-reduce on the one-rank group and let fxfuse fuse the sites "
                        "(its op then runs its NCCL fallback): the fallback's cost in the whole model, on one GPU "
                        "(default: off)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on cuda, time the compiled steps uncaptured, as prefill and widths without a graph run: "
                        "each step then pays its host cost (Python, dispatch, launches) too (default: CUDA graphs)")
    p.add_argument("--dynamic", choices=(*DYNAMIC_CHOICES, "both"), default="auto",
                   help="compile the steps for dynamic shapes (on), one graph per batch x width (off), or both, each "
                        "backend measured both ways in one run; auto: static shapes when every width is captured in a "
                        "CUDA graph, dynamic otherwise (default auto)")
    p.add_argument("--weights", type=spelled(WEIGHT_SPELLINGS), choices=("bf16", "fp8", "int4"), default="bf16",
                   help="random weights kept in bf16 (also spelled bfloat16), as FP8 blocks or as INT4 routed experts; "
                        "FXFUSE_FP8_GEMM picks the FP8 GEMM (default bf16)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=OUT_DIR_HELP)


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse bench kernel`."""
    p.add_argument("--world-size", type=at_least(1), default=None,
                   help="ranks to spawn (default: visible GPUs, at least 2); ignored under torchrun")
    p.add_argument("--tokens", default=_joined(DEFAULT_KERNEL_TOKENS),
                   help=f"comma-separated token counts (default {_joined(DEFAULT_KERNEL_TOKENS)})")
    p.add_argument("--hidden", default=_joined(DEFAULT_HIDDEN),
                   help=f"comma-separated hidden sizes (default {_joined(DEFAULT_HIDDEN)})")
    add_dtype_option(p, ("bfloat16", "float16"), "bfloat16", "activations and weight (default bfloat16)")
    p.add_argument("--variants", default=_joined(KERNEL_VARIANTS),
                   help=f"comma-separated subset of {', '.join(KERNEL_VARIANTS)} (default: all)")
    p.add_argument("--repeats", type=at_least(1), default=None,
                   help="timed replays per point (default 50, 5 when ranks share GPUs)")
    p.add_argument("--graph-iters", type=at_least(1), default=20,
                   help="calls captured in one CUDA graph (default 20)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=OUT_DIR_HELP)
    p.add_argument("--write-thresholds", type=Path, metavar="PATH",
                   help="also write (merge into) a thresholds file derived from the medians (default: none)")


def check_kernel_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (through `p.error`) for kernel-benchmark options argparse cannot check itself."""
    for flag, text in (("--tokens", args.tokens), ("--hidden", args.hidden)):
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            p.error(f"argument {flag}: expected comma-separated integers, got {text!r}")
        if min(values) < 1:
            p.error(f"argument {flag}: values must be at least 1 (got {text!r})")
    unknown = set(args.variants.split(",")) - set(KERNEL_VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(KERNEL_VARIANTS)}")


def add_fallback_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse bench fallback`."""
    p.add_argument("--tokens", type=int_list(1, 1 << 20), default=DEFAULT_FALLBACK_TOKENS,
                   help=f"comma-separated token counts (default {_joined(DEFAULT_FALLBACK_TOKENS)})")
    p.add_argument("--hidden", type=int_list(8, 1 << 16), default=DEFAULT_HIDDEN,
                   help=f"comma-separated hidden sizes (default {_joined(DEFAULT_HIDDEN)})")
    p.add_argument("--quant", type=comma_subset(FALLBACK_QUANT), default=list(FALLBACK_QUANT),
                   help="what follows the norm: none, FP8 per token group of 128 (group), per row (row), with one "
                        "static scale (tensor), per row times the scale's reciprocal as vLLM writes it (row_reciprocal), "
                        "per group of 128 with vLLM's UE8M0 power-of-two scales (group_ue8m0), no FP8 but a clamp then "
                        "a scale (clamp_scale) or a second RMSNorm (second_rmsnorm), which fxfuse leaves to Inductor "
                        "after its all-reduce-only op (tier b); comma-separated "
                        f"(default {_joined(FALLBACK_QUANT)})")
    p.add_argument("--without", type=comma_subset(PATTERNS), default=[],
                   help="compile the fxfuse variant without these passes (`fxfuse.passes.config.PATTERNS`; "
                        "comma-separated): `--without fp8_epilogue` leaves every FP8 quantization unfolded, so such "
                        "sites go to tier (b) (the all-reduce-only op, then Inductor's add, norm and quantization); "
                        "default: every pass")
    p.add_argument("--modes", type=comma_subset(FALLBACK_MODES), default=list(FALLBACK_MODES),
                   help="compile with static shapes (dynamic=False: one compile per token count) and/or dynamic "
                        f"shapes (dynamic=True); comma-separated (default {_joined(FALLBACK_MODES)})")
    # Compiles, not replays, take the sweep's time: 30 x 20 replays of both variants cost about 0.3 s at
    # 4096 x 7168 (at the Inductor and fallback times measured there), far less at fewer tokens, against an
    # estimated second or two per compile.
    p.add_argument("--repeats", type=at_least(1), default=30, help="timing samples per point and variant (default 30)")
    p.add_argument("--iters", type=at_least(1), default=20, help="calls captured in one CUDA graph (default 20)")
    p.add_argument("--host-calls", type=at_least(1), default=200,
                   help="uncaptured calls timed for the host cost (default 200)")
    p.add_argument("--input-sets", type=at_least(0), default=0,
                   help="copies of each point's inputs that successive captured calls cycle through, so that a call "
                        "reads inputs no recent call left in the GPU's L2 cache, as in a model, where a layer's weights "
                        "pass through L2 between two sites; 0 (default): enough copies to cover twice the L2 cache, at "
                        "most --iters; 1: every call reads the same inputs (L2-hot; earlier reports)")
    p.add_argument("--time-budget-s", type=positive_float, default=None,
                   help="start no new point after this many seconds; the rest are listed as skipped (default: no budget)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=OUT_DIR_HELP)


def check_fallback_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError for fallback-benchmark options argparse cannot check itself."""
    misfits = [h for h in args.hidden if h % QUANT_GROUP]
    grouped = [kind for kind in args.quant if kind.startswith("group")]
    if grouped and misfits:
        raise ValueError(f"--quant {grouped[0]} needs hidden sizes that are multiples of {QUANT_GROUP} (got {_joined(misfits)})")


def add_gemm_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse bench gemm`."""
    p.add_argument("--tokens", type=int_list(1, 1 << 16), default=DEFAULT_GEMM_TOKENS,
                   help=f"comma-separated token counts (default {_joined(DEFAULT_GEMM_TOKENS)})")
    p.add_argument("--parts", type=comma_subset(GEMM_PARTS), default=list(GEMM_PARTS),
                   help=f"comma-separated parts to run, of {', '.join(GEMM_PARTS)} (default both)")
    p.add_argument("--repeats", type=at_least(1), default=20, help="timing samples per point and variant (default 20)")
    p.add_argument("--iters", type=at_least(1), default=10, help="calls captured in one CUDA graph (default 10)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=OUT_DIR_HELP)


def add_compile_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fxfuse bench compile`."""
    p.add_argument("--models", type=comma_subset(COMPILE_MODELS), default=list(COMPILE_MODELS),
                   help=f"comma-separated models, of {', '.join(COMPILE_MODELS)} (default both)")
    p.add_argument("--backends", type=comma_subset(COMPILE_BACKENDS), default=list(COMPILE_BACKENDS),
                   help=f"comma-separated backends, of {', '.join(COMPILE_BACKENDS)} (default both)")
    p.add_argument("--layers", type=at_least(1), default=DEFAULT_COMPILE_LAYERS,
                   help=f"decoder layers of each model (default {DEFAULT_COMPILE_LAYERS})")
    p.add_argument("--repeats", type=at_least(1), default=DEFAULT_COMPILE_REPEATS,
                   help=f"cold + warm pairs per model and backend, each on a fresh cache; medians are reported "
                        f"(default {DEFAULT_COMPILE_REPEATS})")
    p.add_argument("--compile-threads", type=at_least(1), default=None,
                   help="Inductor's compile_threads (default: Inductor's own choice for this machine)")
    p.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="bf16 (default) or fp8: FP8 block weights whose GEMMs quantize their input (w8a8), so the graph "
                        "holds an FP8 quantization after each norm that fxfuse folds (deepseek-v3 only: the tiny preset's "
                        "tp 2 slices do not fill whole FP8 blocks)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help=OUT_DIR_HELP)
