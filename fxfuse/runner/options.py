"""`fxfuse run` options and their validation, without importing torch (CUDA checks aside).

`RunOptions` is everything `fxfuse run` takes; its defaults are the built-in job: the tiny preset
compiled with the fxfuse backend at tp=2 on CPU and checked against the eager model. `prepare_run(options)`
checks it in the launching process, before any rank starts, and returns a `RunSetup` (the options with
the CUDA-graph, dtype and inner-compiler choices resolved, the model config, where the weights come from; its
`dynamic_shapes` resolves `--dynamic`) or raises `RunError` with a message that names the problem: unknown
preset, unreadable or malformed checkpoint (its config.json, or its safetensors headers), tp size that
does not divide the model (naming the sizes that do), a tp other than torchrun's world size (under
torchrun), CUDA asked where there is none, more GPUs asked than present, bad backend, inner compiler,
dtype or dynamic-shapes choice, CUDA graphs or graph widths without CUDA, a step width above 128, a KV
cache longer than the model allows, a bad FXFUSE_* setting of the fused op, or a memory plan that does
not fit the GPU (CUDA) or this machine's memory (CPU: every rank shares it). The cheap checks come first
and need no torch; the settings' thresholds file, the checkpoint headers and the memory plan import it.
`fxfuse.runner.setup` then builds the model on each rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from fxfuse.models.config import ModelConfig
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.presets import get_preset
from fxfuse.runner.errors import RunError
from fxfuse.runner.torchrun import check_tp_matches_launch

#: How a step can be compiled (`fxfuse.runner.step_backends.compile_step`).
BACKENDS = ("eager", "inductor", "fxfuse")
#: What compiles the graph after the fxfuse passes (`fxfuse.backend.FxfuseBackend(inner=...)`), and the
#: default per device: on CPU eager shows the fusion fastest (the built-in job's two compiles took 37 s
#: with it on 2 cores, 2 min 25 s with Inductor's C++ code generation); on CUDA, Inductor.
INNER_COMPILERS = ("eager", "inductor")
DEFAULT_INNER = {"cpu": "eager", "cuda": "inductor"}
#: `--compare` targets, `--dtype` names (with their size in bytes) and `--device` names.
COMPARE_TARGETS = ("none", "eager", "hf")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEVICES = ("cpu", "cuda")
#: Why GPU runs use bfloat16 (`fxfuse run --device cuda`, and `fxfuse plan` and `report`, which plan or trace them).
BF16_WHY = "the fused all-reduce kernels take 16-bit activations only"
#: The `--dtype` of `fxfuse run` per device, and why.
DEFAULT_DTYPE = {"cpu": ("float32", "the check against eager then sees float32 rounding only"), "cuda": ("bfloat16", BF16_WHY)}
#: Default widths (tokens per sequence per step) that get their own CUDA graph.
DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Widest step (tokens per sequence) the runner takes, with or without a CUDA graph.
MAX_STEP_WIDTH = 128
#: `--dynamic` choices: compile the step for dynamic shapes (on), static shapes (off), or decide (auto).
DYNAMIC_CHOICES = ("auto", "on", "off")
#: Above this many parameters, random weights are generated per shard (not as one full state dict).
FULL_RANDOM_STATE_LIMIT = 500_000_000


@dataclass(frozen=True)
class RunOptions:
    """Everything `fxfuse run` takes; defaults are the README's built-in job.

    `inner` None means the device's default (`DEFAULT_INNER`; backend fxfuse only), `dtype` None the
    device's (`DEFAULT_DTYPE`: float32 on cpu, bfloat16 on cuda). `cuda_graph` None
    means: on for device cuda, off for cpu. `graph_widths` are the step widths (tokens per sequence)
    that get a captured graph (None: `DEFAULT_WIDTHS`); other widths run uncaptured.
    """

    preset: str | None = "tiny"
    checkpoint: str | None = None
    layers: int | None = None
    tp: int = 2
    device: str = "cpu"
    backend: str = "fxfuse"
    inner: str | None = None
    dtype: str | None = None
    batch: int = 2
    prompt_len: int = 12
    tokens_per_step: int = 1
    steps: int = 4
    compare: str = "eager"
    seed: int = 0
    cuda_graph: bool | None = None
    graph_widths: tuple[int, ...] | None = None
    weights: str = "bf16"
    dynamic: str = "auto"


@dataclass(frozen=True)
class RunSetup:
    """A validated run: the resolved options, the model config and where the weights come from.

    In `options`, `cuda_graph` is a bool, `graph_widths` the widths that get a CUDA graph, ascending
    (empty without CUDA graphs), `dynamic` "on" or "off" and `inner` the inner compiler of backend
    fxfuse (None for the other backends), so the summary's copy of the options says what ran.
    """

    options: RunOptions
    config: ModelConfig
    model_name: str
    full_random_state: bool
    quant: QuantScheme = QuantScheme()

    @property
    def cuda_graph(self) -> bool:
        """Whether the step is captured in CUDA graphs."""
        return bool(self.options.cuda_graph)

    @property
    def graph_widths(self) -> tuple[int, ...]:
        """The widths that get a CUDA graph, ascending; empty without CUDA graphs."""
        return self.options.graph_widths

    @property
    def dynamic_shapes(self) -> bool:
        """Whether the step is compiled for dynamic shapes (`options.dynamic`, "on" or "off" once
        `prepare_run` resolved "auto": see `auto_dynamic`)."""
        return resolve_dynamic(self.options.dynamic, auto_dynamic(self.options))

    @property
    def max_seq_len(self) -> int:
        """KV-cache length: the prompt plus every verify step with one step of slack, and at
        least the widest captured graph (capture writes positions 0..width-1)."""
        return needed_cache_len(self.options, self.graph_widths)

    @property
    def fused_kernel_tokens(self) -> int:
        """Tokens the fused kernel's workspace is sized for (`fxfuse.prepare(..., max_tokens)`): what
        the CUDA graphs replay, batch x the widest graph width, or batch x tokens per step without
        graphs. A larger call (a long prefill) runs the op's fallback, uncaptured."""
        o = self.options
        return o.batch * max(self.graph_widths, default=o.tokens_per_step)


def auto_dynamic(options: RunOptions) -> bool:
    """What `--dynamic auto` means for a run whose CUDA graphs are resolved (`_resolve_graphs`): static
    shapes (False) when the verify step replays a captured CUDA graph (one compile per captured width,
    plus the prefill, as engines that capture one graph per width compile: Inductor's code for static
    shapes is faster) and without CUDA graphs (two shapes, the prefill and the verify step, each
    compiled once); dynamic shapes (True) when CUDA graphs are captured but not for the verify width,
    so that one graph serves the captured widths and the uncaptured one."""
    return bool(options.cuda_graph) and options.tokens_per_step not in options.graph_widths


def resolve_dynamic(choice: str, when_auto: bool) -> bool:
    """The `dynamic` argument of `torch.compile` for a `--dynamic` choice: True for "on", False for
    "off", `when_auto` (the caller's rule) for "auto"; ValueError for anything else."""
    if choice not in DYNAMIC_CHOICES:
        raise ValueError(f"unknown dynamic-shapes choice {choice!r}; choose one of: {', '.join(DYNAMIC_CHOICES)}")
    return when_auto if choice == "auto" else choice == "on"


def prepare_run(options: RunOptions) -> RunSetup:
    """Validate `options` and resolve the model config; raises RunError naming the problem."""
    _check_choice("backend", options.backend, BACKENDS)
    _check_choice("dynamic-shapes choice", options.dynamic, DYNAMIC_CHOICES)
    _check_choice("compare", options.compare, COMPARE_TARGETS)
    _check_choice("device", options.device, DEVICES)
    options = replace(options, dtype=options.dtype or DEFAULT_DTYPE[options.device][0])
    _check_choice("dtype", options.dtype, DTYPE_BYTES)
    if options.inner is not None:
        _check_choice("inner compiler", options.inner, INNER_COMPILERS)
        if options.backend != "fxfuse":
            raise RunError(f"--inner applies to --backend fxfuse only (got --backend {options.backend})")
    for name, flag in (("tp", "--tp"), ("batch", "--batch"), ("prompt_len", "--prompt-len"),
                       ("tokens_per_step", "--tokens"), ("steps", "--steps")):
        if getattr(options, name) < 1:
            raise RunError(f"{flag} must be at least 1 (got {getattr(options, name)})")
    if options.tokens_per_step > MAX_STEP_WIDTH:
        raise RunError(f"--tokens must be at most {MAX_STEP_WIDTH} (got {options.tokens_per_step})")
    check_tp_matches_launch(options.tp)  # under torchrun: the processes it started are the ranks
    _check_device(options.device, options.tp)
    options = _resolve_graphs(options)
    dynamic = resolve_dynamic(options.dynamic, auto_dynamic(options))
    options = replace(options, dynamic="on" if dynamic else "off")
    if options.backend == "fxfuse":
        options = replace(options, inner=options.inner or DEFAULT_INNER[options.device])
    if bool(options.checkpoint) == bool(options.preset):
        raise RunError("give exactly one of --preset NAME or --checkpoint DIR")
    config, name = resolve_model(options.preset, options.checkpoint, options.layers)
    check_tp(config, options.tp)
    cache_len = needed_cache_len(options, options.graph_widths)
    if cache_len > config.max_position_embeddings:
        raise RunError(
            f"the KV cache would need {cache_len} positions (prompt {options.prompt_len} + {options.steps} steps of "
            f"{options.tokens_per_step} tokens, or the widest CUDA graph), more than the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    full_random = not options.checkpoint and config.num_parameters() <= FULL_RANDOM_STATE_LIMIT
    if options.compare == "hf" and not (options.checkpoint or full_random):
        raise RunError(f"--compare hf needs a checkpoint or a model under {FULL_RANDOM_STATE_LIMIT:,} parameters")
    if options.device == "cpu":  # the weights alone, from the config: no torch needed to refuse a huge model
        copies = 2 if options.compare == "eager" else 1
        check_host_memory(config, options.dtype, copies, "use --preset tiny or fewer --layers")
    interconnect = "nvlink"
    if options.backend == "fxfuse":
        from fxfuse.runner.op_settings import checked_op_settings, planned_interconnect

        interconnect = planned_interconnect(checked_op_settings())
    quant = _check_weights_and_memory(options, config, name, cache_len, interconnect)
    return RunSetup(options=options, config=config, model_name=name, full_random_state=full_random, quant=quant)


def _check_weights_and_memory(options: RunOptions, config: ModelConfig, name: str, cache_len: int, interconnect: str) -> QuantScheme:
    """The run's weight format, after checking that the model can be built that way, that the checkpoint's
    headers match it and that the memory plan fits (GPU 0 on CUDA, this machine on CPU); imports torch."""
    from fxfuse.runner.quant_setup import check_fits, weight_scheme

    try:
        quant = weight_scheme(options, config)
        available = None if options.device == "cuda" else available_host_memory()  # CUDA: GPU 0's, asked by check_fits
        check_fits(options, config, name, quant, options.graph_widths, cache_len, interconnect, available)
    except ValueError as exc:
        raise RunError(str(exc)) from exc
    if options.checkpoint:
        import torch

        from fxfuse.runner.checkpoint_check import check_checkpoint

        check_checkpoint(options.checkpoint, config, options.tp, getattr(torch, options.dtype), quant)
    return quant


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise RunError when `tp` ranks cannot split `config`, naming the dimensions and the sizes that can."""
    try:
        config.check_tensor_parallel(tp)
    except ValueError as exc:
        raise RunError(f"{exc}; tensor-parallel sizes that fit this model: {', '.join(map(str, tp_sizes(config)))}") from None


def tp_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size that splits `config` evenly (each divides the attention heads)."""
    sizes = []
    for size in range(1, config.num_attention_heads + 1):
        try:
            config.check_tensor_parallel(size)
        except ValueError:
            continue
        sizes.append(size)
    return sizes


def needed_cache_len(options: RunOptions, graph_widths: tuple[int, ...]) -> int:
    """KV-cache positions a run needs: prompt, every step plus one of slack, the widest graph."""
    steps_len = options.prompt_len + (options.steps + 1) * options.tokens_per_step + 1
    return max(steps_len, max(graph_widths, default=0))


def resolve_model(preset: str | None, checkpoint: str | None, layers: int | None) -> tuple[ModelConfig, str]:
    """(config, model name) of a preset or a checkpoint directory's config.json, cut to the first
    `layers` layers; raises RunError for an unknown preset, an unreadable config.json (naming the
    file) or `layers` outside 1..the model's layer count."""
    if checkpoint:
        config, name = checkpoint_config(checkpoint), os.path.abspath(checkpoint)
    else:
        try:
            config, name = get_preset(preset), preset
        except ValueError as exc:  # names the presets there are
            raise RunError(str(exc)) from exc
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise RunError(f"--layers must be between 1 and {config.num_hidden_layers} (got {layers})")
        config = replace(config, num_hidden_layers=layers)
    return config, name


def checkpoint_config(directory: str) -> ModelConfig:
    """The `ModelConfig` of `directory/config.json`; RunError naming the directory or file if unreadable."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise RunError(f"--checkpoint {directory!r} is a file; give the directory that holds config.json and the "
                       ".safetensors files")
    if not os.path.isdir(directory):
        raise RunError(f"checkpoint directory {directory!r} has no config.json: the directory does not exist")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise RunError(f"checkpoint directory {directory!r} has no config.json")
    try:
        return ModelConfig.from_pretrained(directory)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise RunError(f"cannot read {path}: {exc}") from exc


def check_host_memory(config: ModelConfig, dtype: str, copies: int, advice: str) -> None:
    """Raise RunError when `copies` copies of the model's weights in `dtype` (all ranks of a CPU run
    share this machine's memory) exceed the memory available now; nothing when that is unknown."""
    available = available_host_memory()
    needed = config.num_parameters() * DTYPE_BYTES[dtype] * copies
    if available is not None and needed > available:
        raise RunError(
            f"the weights need at least {needed / 1e9:.1f} GB of memory ({config.num_parameters() / 1e9:.2f} B "
            f"parameters in {dtype}{f', {copies} copies' if copies > 1 else ''}), more than this machine has "
            f"available ({available / 1e9:.1f} GB); {advice}"
        )


def available_host_memory() -> int | None:
    """Bytes of memory available to new processes (Linux `MemAvailable`), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _resolve_graphs(options: RunOptions) -> RunOptions:
    """The options with `cuda_graph` decided (on by default for cuda, refused on cpu) and
    `graph_widths` the sorted widths to capture (empty without CUDA graphs; given without them: refused)."""
    cuda_graph = options.device == "cuda" if options.cuda_graph is None else options.cuda_graph
    if cuda_graph and options.device != "cuda":
        raise RunError("--cuda-graph needs --device cuda (CUDA graphs capture GPU work)")
    if options.graph_widths is not None and not cuda_graph:
        needs = "--device cuda" if options.device != "cuda" else "CUDA graphs (drop --no-cuda-graph)"
        raise RunError(f"--graph-widths needs {needs}: the widths are those that get a CUDA graph")
    widths = tuple(sorted(set(DEFAULT_WIDTHS if options.graph_widths is None else options.graph_widths)))
    if not widths or not all(1 <= w <= MAX_STEP_WIDTH for w in widths):
        raise RunError(f"--graph-widths must be widths between 1 and {MAX_STEP_WIDTH} (got {list(widths)})")
    return replace(options, cuda_graph=cuda_graph, graph_widths=widths if cuda_graph else ())


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise RunError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")


def _check_device(device: str, tp: int) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise RunError("--device cuda was asked for, but this machine has no CUDA GPU (use --device cpu)")
    present = torch.cuda.device_count()
    if tp > present:
        raise RunError(f"--tp {tp} needs {tp} GPUs (one process per GPU), but only {present} are present")
