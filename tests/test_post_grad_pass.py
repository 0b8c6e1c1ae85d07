"""`fxfuse.post_grad_pass()`: fxfuse's passes inside a compile whose backend is not fxfuse.

Fast: the order of one call (the user's passes, then merge + fusion, then donation) on a post-grad
graph of the toy decoder; records, counters and dumps as the backend keeps them; what the uuid covers (config, user passes, source files; not the machine or FXFUSE_FUSION) and that
it is None when a user pass has none; how a `post_grad_custom_post_pass` value is read.
Slow (Inductor compiles): the tiny DeepSeek-V3 on 2 gloo ranks compiled with `backend="inductor"` and
the pass, against `backend=FxfuseBackend()` (same counts, same logits, both within 1e-5 of eager);
the README's example with the pass and `mode="max-autotune"` on 2 gloo ranks; a framework backend that
calls Inductor itself, with a user pass composed (it runs, it is in the cache key, a hit replays the
record); the uuid equal in another process, also under FXFUSE_FUSION=off.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.custom_graph_pass import CustomGraphPass
from toy_graphs import RMSNORMS, decoder_inputs, fake_process_group, post_grad_graph, toy_decoder

import fxfuse
import fxfuse.op.decide.flashinfer_version
import fxfuse.post_grad
from fxfuse.backend import FxfuseBackend
from fxfuse.op.schema import DONATING_TWIN, FUSED_OPS
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, PATTERNS
from fxfuse.passes.pattern_support import ALL_REDUCE
from fxfuse.post_grad import FusionPostGradPass, hashed_sources, post_grad_pass, sources_digest, user_passes_of

FUSED = "fxfuse.allreduce_residual_rmsnorm"


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


def graph_ops(graph: torch.fx.Graph) -> tuple[int, int, int]:
    """(all-reduces, functional fused ops, donating fused ops) in `graph`."""
    all_reduces = len(graph.find_nodes(op="call_function", target=ALL_REDUCE))
    fused = sum(len(graph.find_nodes(op="call_function", target=op)) for op in FUSED_OPS)
    donating = sum(1 for node in graph.find_nodes(op="call_function", target=auto_functionalized)
                   if node.args[0] in DONATING_TWIN.values())
    return all_reduces, fused, donating


class LoggingPass(CustomGraphPass):
    """A user's pass: logs its name and the ops of the graph it was given."""

    def __init__(self, name: str, log: list, uuid: str | None = "logging-pass-1") -> None:
        self.name, self.log, self._uuid = name, log, uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.log.append((self.name, graph_ops(graph)))

    def uuid(self) -> str | None:
        return self._uuid


# ---------------------------------------------------------------- one call, on a post-grad graph


def test_user_passes_run_first_then_fusion_then_donation(group):
    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
    gm = post_grad_graph(decoder, *decoder_inputs(torch.float32))
    log = []
    fusion = post_grad_pass([LoggingPass("theirs", log), lambda graph: log.append(("plain", graph_ops(graph)))])
    fusion(gm.graph)
    assert log == [("theirs", (4, 0, 0)), ("plain", (4, 0, 0))]  # in the given order, on the unfused graph
    assert graph_ops(gm.graph) == (0, 0, 4)  # every site fused, then donated
    (record,) = fusion.records
    assert (record.stats.fused_without_residual, record.stats.fused_with_residual, record.from_cache) == (1, 3, False)
    assert record.after.op_counts[FUSED] == 4  # the recorded graph is the fused one, before donation


@pytest.mark.skipif(fxfuse.post_grad._INFERENCE_AWARE is None, reason="this torch has no inference-aware custom passes")
def test_inference_aware_user_pass_gets_the_flag(group):
    seen = []

    class Aware(fxfuse.post_grad._INFERENCE_AWARE):
        def __call__(self, graph, is_inference):
            seen.append(is_inference)

        def uuid(self):
            return "aware-1"

    assert isinstance(post_grad_pass(), fxfuse.post_grad._INFERENCE_AWARE)  # so Inductor hands it the flag
    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
    post_grad_pass(Aware())(post_grad_graph(decoder, *decoder_inputs(torch.float32)).graph, is_inference=True)
    assert seen == [True]


def test_records_counters_and_dump_like_the_backend(group, tmp_path):
    from torch._dynamo.utils import counters

    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
    counters.clear()
    fusion = post_grad_pass(patterns=[ALLREDUCE_RESIDUAL_RMSNORM], dump_dir=tmp_path)
    fusion(post_grad_graph(decoder, *decoder_inputs(torch.float32)).graph)
    assert fusion.records[-1].stats.fused == 3  # no pattern 2: the embedding's site stays
    assert counters["fxfuse"]["fused_with_residual"] == 3 and counters["fxfuse"]["fused_without_residual"] == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "graph_000_rank0.after.txt", "graph_000_rank0.before.txt", "graph_000_rank0.diff.txt"]
    assert [name for name in counters["inductor"] if name.startswith("fxfuse:")]  # the mark a cached graph keeps


# ---------------------------------------------------------------- the uuid


def test_uuid_is_deterministic_and_covers_the_config():
    default = post_grad_pass().uuid()
    assert default == post_grad_pass().uuid() == post_grad_pass(patterns=list(reversed(PATTERNS))).uuid()
    assert default[1] == ()  # no user pass
    others = {post_grad_pass(patterns=[ALLREDUCE_RESIDUAL_RMSNORM]).uuid(), post_grad_pass(patterns=()).uuid(),
              post_grad_pass(fuse_without_fast_kernel=True).uuid()}
    assert default not in others and len(others) == 3


def test_uuid_covers_the_user_passes():
    log = []
    first, second = post_grad_pass(LoggingPass("a", log, "v1")).uuid(), post_grad_pass(LoggingPass("a", log, "v2")).uuid()
    assert first[1] == ("v1",) and second[1] == ("v2",) and first[0] == second[0] == post_grad_pass().uuid()[0]
    assert post_grad_pass([LoggingPass("a", log, "v1"), LoggingPass("b", log, "w")]).uuid()[1] == ("v1", "w")
    # a pass Inductor cannot key on turns its caches off, as it would for that pass alone
    assert post_grad_pass(lambda graph: None).uuid() is None
    assert post_grad_pass(LoggingPass("a", log, None)).uuid() is None


def test_uuid_ignores_the_machine_and_the_settings(monkeypatch):
    """The rewrite reads graph facts only, so a cached graph is right whatever FXFUSE_FUSION or the
    installed FlashInfer say: the op reads those when it runs."""
    default = post_grad_pass().uuid()
    monkeypatch.setenv("FXFUSE_FUSION", "off")
    monkeypatch.setattr(fxfuse.op.decide.flashinfer_version, "installed_version", lambda: "0.7.2")
    assert post_grad_pass().uuid() == default


def test_sources_digest_follows_every_file_and_not_the_checkout(tmp_path):
    digest = sources_digest.__wrapped__  # uncached: these files change below
    for checkout in ("a", "b"):
        (tmp_path / checkout / "passes").mkdir(parents=True)
        for name in ("one.py", "two.py"):
            (tmp_path / checkout / "passes" / name).write_text(f"# {name}\n")
    files = {checkout: tuple(sorted((tmp_path / checkout / "passes").glob("*.py"))) for checkout in ("a", "b")}
    assert digest(files["a"]) == digest(files["b"])
    before = digest(files["a"])
    files["a"][1].write_text("# two.py, changed\n")
    assert digest(files["a"]) != before


def test_hashed_sources_cover_the_pass_code():
    names = {f"{path.parent.name}/{path.name}" for path in hashed_sources()}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = [os.path.join(repo, "passes"), os.path.join(repo, "fxfuse", "rewrite")]
    folders += [root for root, _, _ in os.walk(os.path.join(repo, "fxfuse", "op")) if "__pycache__" not in root]
    for folder in folders:
        expected = {f"{os.path.basename(folder)}/{name}" for name in os.listdir(folder) if name.endswith(".py")}
        assert expected and expected <= names, folder
    assert "fxfuse/post_grad.py" in names and "fxfuse/backend.py" not in names


@pytest.mark.slow
def test_uuid_is_the_same_in_another_process_and_under_fxfuse_fusion_off():
    code = "import fxfuse; print(fxfuse.post_grad_pass().uuid())"

    def uuid_in_process(**env) -> str:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    first = uuid_in_process(PYTHONHASHSEED="1")
    assert first == uuid_in_process(PYTHONHASHSEED="2") == str(post_grad_pass().uuid())
    assert uuid_in_process(FXFUSE_FUSION="off") == first


# ---------------------------------------------------------------- what the slot may hold


def test_reading_the_slot():
    log = []
    theirs = LoggingPass("theirs", log)
    assert user_passes_of(None, owner="x") == ()
    assert user_passes_of(theirs, owner="x") == (theirs,)
    assert user_passes_of([theirs, print], owner="x") == (theirs, print)
    # wrapping fxfuse's pass again replaces it and keeps the user's: no double fusion
    wrapped = post_grad_pass(post_grad_pass(theirs))
    assert isinstance(wrapped, FusionPostGradPass) and wrapped.user_passes == (theirs,)
    with pytest.raises(TypeError, match=r"^fxfuse.post_grad_pass: a user pass must be a callable .* not int$"):
        post_grad_pass(3)
    with pytest.raises(TypeError, match="not FusionPostGradPass"):
        post_grad_pass([post_grad_pass()])


def test_lazy_export():
    assert fxfuse.post_grad_pass is post_grad_pass


# ---------------------------------------------------------------- Inductor compiles


def _tiny_model_both_ways(ctx, cache_dir: str):
    """One rank: a 4-token step of the 2-layer tiny model (fp32) compiled with `backend="inductor"` + the
    pass and with `FxfuseBackend()`, and eager. Inductor's graph caches are off, so each compile runs its
    passes; its kernel cache is `cache_dir`, fresh and shared by the two compiles and the two ranks (each
    kernel is built once: the compiles differ in no kernel)."""
    from test_model_compile import build_model, decode_schedule

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # this rank's own process
    torch._inductor.config.compile_threads = 1  # no compile worker pool per rank on a small CPU
    model = build_model(ctx)
    prefill, steps = decode_schedule(model.config.vocab_size)
    results = {}
    with torch.inference_mode():
        model.reset_cache()
        model(*prefill)
        results["eager"] = model(*steps[1])
        fusion = post_grad_pass(torch._inductor.config.post_grad_custom_post_pass)
        backend = FxfuseBackend()
        for name, records, compile_kwargs, patch in (
            ("post_grad", fusion.records, {}, {"post_grad_custom_post_pass": fusion}),
            ("backend", backend.records, {"backend": backend}, {}),
        ):
            torch._dynamo.reset()
            model.reset_cache()
            model(*prefill)
            with torch._inductor.config.patch({**patch, "fx_graph_cache": False}), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                results[name] = torch.compile(model, fullgraph=True, dynamic=False, **compile_kwargs)(*steps[1])
            results[f"{name}_records"] = [(r.stats, dict(r.after.op_counts), r.from_cache) for r in records]
    return results


@pytest.mark.slow
def test_tiny_model_fuses_the_same_with_the_pass_as_with_the_backend(tmp_path):
    from fxfuse.runner.launch import run_on_ranks

    for rank in run_on_ranks(_tiny_model_both_ways, 2, str(tmp_path / "inductor"), timeout_s=1200):
        (stats, after, from_cache), = rank["post_grad_records"]
        assert rank["backend_records"] == rank["post_grad_records"]
        sites = 1 + 2 * 2  # the embedding, then attention + MLP/MoE per layer
        assert (stats.allreduces_before, stats.fused_without_residual, stats.fused_with_residual) == (sites, 1, sites - 1)
        assert (stats.allreduces_after, after.get("_c10d_functional.all_reduce", 0), after[FUSED], from_cache) == (0, 0, sites, False)
        torch.testing.assert_close(rank["post_grad"], rank["backend"], rtol=0, atol=0)
        error = float((rank["post_grad"] - rank["eager"]).abs().max() / rank["eager"].abs().max())
        assert error <= 1e-5


def readme_with_post_grad_pass() -> str:
    """The README's example compiled by Inductor (max-autotune) with the pass, instead of backend="fxfuse": its
    `compiled = ...` line replaced by the README's own `fxfuse.post_grad_pass()` block, as that section says."""
    from test_readme import README, example_script, python_blocks

    (block,) = python_blocks(README.read_text(), "Inside another backend: `fxfuse.post_grad_pass()`")
    assert "fxfuse.post_grad_pass(" in block and 'mode="max-autotune"' in block and "\ncompiled = " in block
    script, replaced = re.subn(r'^compiled = torch\.compile\(model, backend="fxfuse", fullgraph=True\).*$',
                               lambda match: block.rstrip("\n"), example_script(), flags=re.M)
    assert replaced == 1
    return script


@pytest.mark.slow
def test_readme_example_with_the_pass_and_max_autotune(tmp_path):
    from fxfuse.runner.launch import free_port

    path = tmp_path / "example.py"
    path.write_text(readme_with_post_grad_pass())
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cold cache: the pass runs
    procs = [subprocess.Popen([sys.executable, str(path)], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"  # the script checks its own numerics
    out = outputs[0][0]
    assert "{'allreduces_before': 1, 'merged': 0, 'fused_with_residual': 1, 'fused_without_residual': 0, " \
           "'allreduces_after': 0, 'fp8_quantizations_folded': 0, 'fast_all_reduces': 0}" in out


@pytest.mark.slow
def test_a_framework_backend_with_a_user_pass(group):
    """A backend that calls Inductor itself; the user's pass composed: it runs first, its uuid is in the
    cache key (a new one compiles again), and a hit replays the record without running anything."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_inductor_cache

    def framework_backend(gm, example_inputs):
        return compile_fx(gm, example_inputs)

    decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
    inputs = decoder_inputs(torch.bfloat16)
    with torch.no_grad():
        expected = decoder(*inputs)
    log = []

    def compile_with(user_pass):
        fusion = post_grad_pass(user_pass)
        torch._dynamo.reset()
        counters.clear()
        with torch._inductor.config.patch(post_grad_custom_post_pass=fusion), torch.no_grad():
            out = torch.compile(decoder, backend=framework_backend, fullgraph=True)(*inputs)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)  # bf16: the fused op keeps the rounding order
        (record,) = fusion.records
        assert record.stats.fused == 4 and record.stats.allreduces_after == 0
        return record, Counter({k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")})

    with fresh_inductor_cache():
        cold, caches = compile_with(LoggingPass("theirs", log, "v1"))
        assert (log, caches, cold.from_cache) == ([("theirs", (4, 0, 0))], Counter(fxgraph_cache_miss=1), False)
        warm, caches = compile_with(LoggingPass("theirs", log, "v1"))
        assert (len(log), caches, warm.from_cache) == (1, Counter(fxgraph_cache_hit=1), True)
        assert (warm.stats, warm.before.lines, warm.after.lines) == (cold.stats, cold.before.lines, cold.after.lines)
        _, caches = compile_with(LoggingPass("theirs", log, "v2"))
        assert (len(log), caches) == (2, Counter(fxgraph_cache_miss=1))
        _, caches = compile_with(lambda graph: log.append(("plain", graph_ops(graph))))
        assert (log[-1], caches) == (("plain", (4, 0, 0)), Counter(fxgraph_cache_bypass=1))
        # the fxfuse backend, too, runs the pass it finds in the slot
        backend = FxfuseBackend()
        with torch._inductor.config.patch(post_grad_custom_post_pass=LoggingPass("theirs", log, "v3")), torch.no_grad():
            torch._dynamo.reset()
            torch.compile(decoder, backend=backend, fullgraph=True)(*inputs)
        assert log[-1] == ("theirs", (4, 0, 0)) and backend.records[-1].stats.fused == 4
