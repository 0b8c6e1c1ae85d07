"""Which torch releases fxfuse was tested on, and one warning for any other.

The range is declared in one place, pyproject.toml's `torch` requirement (its upper bound: the newest
release the whole suite passed on), and read here from fxfuse's installed metadata, so that the runtime
check, `fxfuse --version`-style messages and the docs cannot drift apart. A torch outside it still runs:
its graphs may spell the chain in ways the passes do not know, so fewer sites may fuse; the warning
says so once per process, naming the tested range and where to see what fused.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

log = logging.getLogger(__name__)


@functools.cache
def supported_torch() -> SpecifierSet | None:
    """The torch requirement of the installed fxfuse (None where fxfuse runs from a tree never installed)."""
    try:
        requirements = importlib.metadata.requires("fxfuse") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name == "torch" and requirement.marker is None:
            return requirement.specifier
    return None


def describe_range(specifier: SpecifierSet) -> str:
    """`>=2.11,<2.16` as `2.11 to 2.15` (a `<X.Y` bound names the release before it)."""
    lower = next((s.version for s in specifier if s.operator == ">="), None)
    upper = next((s.version for s in specifier if s.operator == "<"), None)
    if lower is None or upper is None:
        return str(specifier)
    major, minor = Version(upper).release[:2]
    return f"{lower} to {major}.{minor - 1}" if minor else f"{lower} and newer before {upper}"


def unsupported_torch_message(version: str, specifier: SpecifierSet | None) -> str | None:
    """The warning for torch `version` outside `specifier`, or None inside it (or with no range known)."""
    if specifier is None or specifier.contains(Version(version), prereleases=True) and not Version(version).is_prerelease:
        return None
    return (f"fxfuse was tested on torch {describe_range(specifier)} (pyproject.toml: torch{specifier}); torch {version} is "
            "installed: its graphs may spell the all-reduce -> add -> RMSNorm chain or an FP8 quantization in ways the "
            "passes do not know, so fewer sites may fuse (the compile log and `fxfuse report` name each site left unfused)")


@functools.cache
def warn_if_untested() -> None:
    """Log the warning once per process when the installed torch is outside the tested range."""
    import torch

    message = unsupported_torch_message(torch.__version__, supported_torch())
    if message is not None:
        log.warning(message)
