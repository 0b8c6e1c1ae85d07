"""What the passes did, through Python logging: the `fxfuse` logging component.

- WARNING, shown by default: once per compiled graph that leaves all-reduce sites to Inductor's own
  all-reduce (tier (c); a graph Inductor loaded from its cache too, from its record): sites found,
  fused, on the all-reduce-only op (tier (b)), and the most common reason, whose sentence ends with the
  fix where the passes know one (`compile under torch.no_grad() ...` for a graph compiled with grad
  enabled). A graph whose unfused sites are all in tier (b) says the same at INFO: that is a choice.
- INFO, with `TORCH_LOGS=fxfuse`: a line per all-reduce site of each graph the passes rewrite (fused
  into which op, or why not), and the count for a graph where every site fused.
- DEBUG, with `TORCH_LOGS=+fxfuse`: each graph's diff (`CompileRecord.diff`).

The messages come from the `fxfuse.rewrite.log` logger, a child of `fxfuse`. torch reads TORCH_LOGS
when it is imported, before fxfuse can register anything, and takes a name it has not registered
for a module: `TORCH_LOGS=fxfuse` sets the `fxfuse` loggers' level and gives them torch's handler
on every torch from 2.11 to 2.15. Importing this module also registers `fxfuse` as a log of torch's
(`torch._logging._internal.register_log`, skipped where a torch lacks it), so that it is handled
like torch's own components whenever torch sets its logging up again (`torch._logging.set_logs`).
Without either, the warning goes to the root logger, as any library's would.
"""

from __future__ import annotations

import logging

import torch

from fxfuse.rewrite.records import CompileRecord
from fxfuse.rewrite.sites import SiteDecision

#: The logging component, as TORCH_LOGS and `torch._logging.set_logs(modules=...)` name it.
COMPONENT = "fxfuse"

log = logging.getLogger(__name__)


def register_with_torch() -> None:
    """Register the `fxfuse` component with torch's logging, where this torch offers it."""
    register_log = getattr(getattr(torch._logging, "_internal", None), "register_log", None)
    if register_log is not None:
        register_log(COMPONENT, COMPONENT)


def log_sites(decisions: tuple[SiteDecision, ...]) -> None:
    """At INFO: one line per all-reduce site of the graph the passes just rewrote (torch's format, which
    TORCH_LOGS gives, names the graph; the graph's summary line follows them)."""
    if not log.isEnabledFor(logging.INFO):
        return
    for number, decision in enumerate(decisions, 1):
        site = f"fxfuse site {number}/{len(decisions)}: all-reduce `{decision.all_reduce}` of `{decision.producer.name}`"
        if decision.fused:
            how = "merged with another site, then fused" if decision.merged else "fused"
            log.info("%s %s into `%s`", site, how, decision.fused_into.name)
        elif decision.tier == "b":
            log.info("%s on the all-reduce-only op (tier b), add and norm left to Inductor: %s", site, decision.reason)
        else:
            log.info("%s not fused: %s", site, decision.reason)


def log_record(record: CompileRecord) -> None:
    """Once per compiled graph: the warning if sites were left unfused (else the count at INFO), and the
    graph's diff at DEBUG."""
    found = record.stats.allreduces_before
    loaded = " (loaded from Inductor's cache)" if record.from_cache else ""
    if record.unfused is not None:
        unfused = record.unfused
        level = logging.WARNING if unfused.count > unfused.fast else logging.INFO
        fast = f"; {unfused.fast} of the others run the all-reduce-only op (tier b)" if unfused.fast else ""
        log.log(level, "fxfuse fused %d of %d all-reduce sites%s%s%s. Most common reason (%d of the %d unfused): %s. "
                "TORCH_LOGS=fxfuse lists every site.", found - unfused.count, found, _graph(), loaded, fast,
                unfused.with_reason, unfused.count, unfused.reason)
    elif found:
        log.info("fxfuse fused all %d all-reduce sites%s%s", found, _graph(), loaded)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("fxfuse diff%s%s: %s\n%s", _graph(), loaded, record.stats, record.diff())


def _graph() -> str:
    """` of graph <compile id>` inside a torch.compile, else nothing."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return "" if compile_id is None else f" of graph {compile_id}"


register_with_torch()
