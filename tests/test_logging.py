"""The `fxfuse` logging component: a warning once per compiled graph that keeps all-reduce sites
unfused (with the reason and its fix), silence when every site fused, the same through
`fxfuse.post_grad_pass()` and for a graph loaded from Inductor's cache, and the per-site lines of
`TORCH_LOGS=fxfuse` (in a subprocess: torch reads TORCH_LOGS when it is imported)."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from toy_graphs import RMSNORMS, compile_and_run, decoder_inputs, fake_process_group, post_grad_graph, toy_decoder

import fxfuse.rewrite.log
from fxfuse.backend import FxfuseBackend
from fxfuse.passes.config import ALLREDUCE_RESIDUAL_RMSNORM, ALLREDUCE_RMSNORM, PATTERNS
from fxfuse.passes.unfused_reasons import NO_GRAD_ADVICE
from fxfuse.post_grad import post_grad_pass
from fxfuse.rewrite.recorder import FusionRecorder
from fxfuse.rewrite.records import FusionStats, UnfusedSites, mark_name, record_from_mark

TESTS = Path(__file__).resolve().parent
GRAD_REASON = "inside the all-reduce -> RMSNorm chain is saved for backward (grad is enabled): " + NO_GRAD_ADVICE


@pytest.fixture(scope="module")
def group():
    with fake_process_group() as world:
        yield world


class Kept(logging.Handler):
    """Keeps the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [record.getMessage() for record in self.records if record.levelno == level]


@pytest.fixture
def fxfuse_log():
    """What the `fxfuse` loggers say at INFO and above during the test (on their own handler, which sees
    them whether or not torch's logging stops them at `fxfuse`)."""
    logger, kept = logging.getLogger("fxfuse"), Kept()
    level = logger.level
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    yield kept
    logger.removeHandler(kept)
    logger.setLevel(level)


def decoder(group):
    return functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])


def grad_inputs():
    """The toy decoder's inputs with a norm weight that requires grad: AOT autograd compiles a training
    forward, whose norms save their inner values for backward."""
    inputs = decoder_inputs(torch.float32)
    inputs[3].requires_grad_(True)
    return inputs


def test_grad_enabled_graph_warns_once_with_the_reason_and_its_fix(group, fxfuse_log):
    backend = FxfuseBackend(inner="eager")
    torch._dynamo.reset()
    compiled = torch.compile(decoder(group), backend=backend, fullgraph=True)
    for _ in range(3):
        compiled(*grad_inputs())
    (warning,) = fxfuse_log.messages(logging.WARNING)
    assert warning.startswith("fxfuse fused 0 of 4 all-reduce sites of graph 0/0. Most common reason (4 of the 4 unfused): `")
    assert warning.endswith(f"{GRAD_REASON}. TORCH_LOGS=fxfuse lists every site.")
    assert (backend.records[0].unfused.count, backend.records[0].unfused.with_reason) == (4, 4)
    sites = fxfuse_log.messages(logging.INFO)
    assert len(sites) == 4 and all(line.startswith(f"fxfuse site {n}/4: all-reduce `") for n, line in enumerate(sites, 1))
    assert all(line.endswith(GRAD_REASON) and " not fused: `" in line for line in sites)


def test_no_warning_when_every_site_fused(group, fxfuse_log):
    backend, _ = compile_and_run(decoder(group), *decoder_inputs(torch.float32))
    assert backend.records[0].unfused is None
    assert fxfuse_log.messages(logging.WARNING) == []
    *sites, summary = fxfuse_log.messages(logging.INFO)
    assert summary == "fxfuse fused all 4 all-reduce sites of graph 0/0"
    assert [line.split(": ", 1)[0] for line in sites] == [f"fxfuse site {n}/4" for n in range(1, 5)]
    assert all(" fused into `allreduce_residual_rmsnorm_default" in line for line in sites)


def test_the_most_common_reason_is_named_with_its_share(group, fxfuse_log):
    """With the residual pattern off, three sites stay unfused for that and the embedding's site fuses."""
    compile_and_run(decoder(group), *decoder_inputs(torch.float32),
                    backend=FxfuseBackend(inner="eager", patterns=(ALLREDUCE_RMSNORM,)))
    assert fxfuse_log.messages(logging.WARNING) == [
        "fxfuse fused 1 of 4 all-reduce sites of graph 0/0. Most common reason (3 of the 3 unfused): pattern "
        f"{ALLREDUCE_RESIDUAL_RMSNORM} is disabled. TORCH_LOGS=fxfuse lists every site."]


def test_post_grad_pass_warns_once_per_graph(group, fxfuse_log):
    graph = post_grad_graph(decoder(group), *decoder_inputs(torch.float32)).graph
    fxfuse_log.records.clear()  # the capture ran the backend with every pattern off
    post_grad_pass(patterns=[p for p in PATTERNS if p != ALLREDUCE_RMSNORM])(graph)
    (warning,) = fxfuse_log.messages(logging.WARNING)
    assert warning == ("fxfuse fused 3 of 4 all-reduce sites. Most common reason (1 of the 1 unfused): pattern "
                       f"{ALLREDUCE_RMSNORM} is disabled. TORCH_LOGS=fxfuse lists every site.")


def test_a_graph_loaded_from_the_cache_warns_as_its_compile_did(fxfuse_log):
    unfused = UnfusedSites(count=2, reason="`mul` (mul) " + GRAD_REASON, with_reason=2)
    record, _ = record_from_mark(mark_name(FusionStats(2, 0, 0, 0, 2), False, None, unfused))
    assert (record.from_cache, record.unfused) == (True, unfused)
    FusionRecorder().add_record(record)
    assert fxfuse_log.messages(logging.WARNING) == [
        f"fxfuse fused 0 of 2 all-reduce sites (loaded from Inductor's cache). Most common reason (2 of the 2 "
        f"unfused): {unfused.reason}. TORCH_LOGS=fxfuse lists every site."]


def test_fxfuse_is_a_log_of_torchs(monkeypatch):
    assert torch._logging._internal.log_registry.log_alias_to_log_qnames["fxfuse"] == ["fxfuse"]
    monkeypatch.delattr(torch._logging._internal, "register_log")
    fxfuse.rewrite.log.register_with_torch()  # a torch without it: nothing to register, no error


@pytest.mark.slow
def test_inductor_compile_with_grad_warns_once(group, fxfuse_log, tmp_path, monkeypatch):
    """Through Inductor's post-grad slot (`fxfuse.post_grad_pass`, as `backend="fxfuse"` uses it), on a
    fresh Inductor cache so that the pass runs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    fusion = post_grad_pass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=fusion):
        compiled = torch.compile(decoder(group), backend="inductor", fullgraph=True)
        for _ in range(2):
            compiled(*grad_inputs())
    (warning,) = fxfuse_log.messages(logging.WARNING)
    assert warning.startswith("fxfuse fused 0 of 4 all-reduce sites of graph 0/0.") and GRAD_REASON in warning
    assert [record.stats.allreduces_before for record in fusion.records] == [4]


_TORCH_LOGS_RUN = textwrap.dedent("""
    import functools, torch
    from toy_graphs import RMSNORMS, compile_and_run, decoder_inputs, fake_process_group, toy_decoder
    from fxfuse.backend import FxfuseBackend
    with fake_process_group() as group:
        decoder = functools.partial(toy_decoder, group=group, norm=RMSNORMS["transformers"])
        compile_and_run(decoder, *decoder_inputs(torch.float32), backend=FxfuseBackend("eager", patterns=["allreduce_rmsnorm"]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["fxfuse", "+fxfuse"])
def test_torch_logs_shows_each_sites_decision(setting):
    env = {**os.environ, "TORCH_LOGS": setting, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _TORCH_LOGS_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    sites = [line.split("] ", 1)[1] for line in lines if "fxfuse site " in line]
    assert [line.split(": ", 1)[0] for line in sites] == [f"[0/0] fxfuse site {n}/4" for n in range(1, 5)]
    assert " fused into `allreduce_residual_rmsnorm_default" in sites[0]
    assert all(line.endswith(f"not fused: pattern {ALLREDUCE_RESIDUAL_RMSNORM} is disabled") for line in sites[1:])
    assert sum("fxfuse fused 1 of 4 all-reduce sites of graph 0/0." in line for line in lines) == 1
    assert any("  before  after" in line for line in lines) == (setting == "+fxfuse")  # the diff's table
