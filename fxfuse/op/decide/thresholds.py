"""Thresholds table: measured token ranges where each implementation of the fused op is fastest.

One entry per (GPU name, topology, world size, hidden size, dtype) holds ordered token ranges, each
with a mode (`oneshot`, `twoshot`, `pcie` or `fallback`): `{"max_tokens": 64, "mode": "oneshot"},
{"max_tokens": 512, "mode": "twoshot"}` means one-shot up to 64 tokens, two-shot from 65 to 512,
unfused (fallback) above 512. An entry's `topology` (`nvswitch`, `nvlink`, `pcie`, `none`) is
optional; without it (`any`) the entry applies to every topology of that GPU, and an entry for the
group's own topology wins over an `any` entry.

`load_thresholds()` reads fxfuse/op/decide/default_thresholds.json, then an override file (its `path`
argument, else the file named by the FXFUSE_THRESHOLDS environment variable), whose entries
replace default entries with the same key. Entries are written by
`fxfuse bench kernel --write-thresholds`. Every rank must see the same files, since the table
feeds a decision that all ranks must take identically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from fxfuse.op.decide.environment import env_setting
from fxfuse.op.decide.modes import FusionMode

ENV_THRESHOLDS = "FXFUSE_THRESHOLDS"
DEFAULT_PATH = Path(__file__).with_name("default_thresholds.json")
FORMAT = "fxfuse-thresholds/1"

TableKey = tuple[str, str, int, int, str]
#: The topology of an entry that applies to every topology.
ANY_TOPOLOGY = "any"


class ThresholdsError(ValueError):
    """A thresholds file that cannot be read or does not follow the format; names the file."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """The table's spelling of a dtype: 'bfloat16', 'float16', ..."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype.removeprefix("torch.")


def table_key(gpu: str, world_size: int, hidden_size: int, dtype: torch.dtype | str, topology: str = ANY_TOPOLOGY) -> TableKey:
    """The lookup key: GPU name compared case- and space-insensitively."""
    return (" ".join(gpu.lower().split()), str(topology), int(world_size), int(hidden_size), dtype_name(dtype))


@dataclass(frozen=True)
class TokenRange:
    """Token counts up to `max_tokens` (from the previous range's end + 1) use `mode`."""

    max_tokens: int
    mode: FusionMode


@dataclass(frozen=True)
class ThresholdEntry:
    """Measured token ranges for one GPU / world size / hidden size / dtype."""

    gpu: str
    world_size: int
    hidden_size: int
    dtype: str
    ranges: tuple[TokenRange, ...]
    source: str = ""
    topology: str = ANY_TOPOLOGY

    def __post_init__(self) -> None:
        bounds = [r.max_tokens for r in self.ranges]
        if not bounds or bounds[0] < 1 or any(b >= a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"ranges of {self.key()} must be non-empty with strictly increasing max_tokens >= 1")

    def key(self) -> TableKey:
        """This entry's lookup key."""
        return table_key(self.gpu, self.world_size, self.hidden_size, self.dtype, self.topology)

    def spans(self) -> tuple[tuple[int, int, FusionMode], ...]:
        """(first token count, last token count, mode) of each range, in order."""
        firsts = (1, *(r.max_tokens + 1 for r in self.ranges[:-1]))
        return tuple((first, r.max_tokens, r.mode) for first, r in zip(firsts, self.ranges))

    def mode_for(self, num_tokens: int) -> FusionMode:
        """The mode of the first range covering `num_tokens`; fallback beyond the last range."""
        for token_range in self.ranges:
            if num_tokens <= token_range.max_tokens:
                return token_range.mode
        return FusionMode.FALLBACK

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the file format of one entry)."""
        return {
            "gpu": self.gpu,
            "topology": self.topology,
            "world_size": self.world_size,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "ranges": [{"max_tokens": r.max_tokens, "mode": r.mode.value} for r in self.ranges],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ThresholdEntry":
        """Parse one entry; raises KeyError/ValueError/TypeError on malformed data."""
        ranges = tuple(TokenRange(int(r["max_tokens"]), FusionMode(r["mode"])) for r in data["ranges"])
        return cls(
            gpu=str(data["gpu"]),
            world_size=int(data["world_size"]),
            hidden_size=int(data["hidden_size"]),
            dtype=dtype_name(str(data["dtype"])),
            ranges=ranges,
            source=str(data.get("source", "")),
            topology=str(data.get("topology", ANY_TOPOLOGY)),
        )


@dataclass(frozen=True)
class ThresholdTable:
    """All entries, by key. Immutable; `merged` returns a new table."""

    entries: Mapping[TableKey, ThresholdEntry] = field(default_factory=dict)

    def lookup(
        self, gpu: str, world_size: int, hidden_size: int, dtype: torch.dtype | str, topology: str = ANY_TOPOLOGY
    ) -> ThresholdEntry | None:
        """The entry for this GPU/topology/world size/hidden size/dtype (else its `any`-topology entry), or None."""
        exact = self.entries.get(table_key(gpu, world_size, hidden_size, dtype, topology))
        return exact if exact is not None else self.entries.get(table_key(gpu, world_size, hidden_size, dtype))

    def digest(self) -> str:
        """A short checksum of the entries, compared across ranks (they must decide from one table)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def merged(self, override: "ThresholdTable") -> "ThresholdTable":
        """This table with `override`'s entries added, replacing entries with the same key."""
        return ThresholdTable({**self.entries, **override.entries})

    def to_json(self, description: str = "") -> dict[str, Any]:
        """The file content for this table."""
        return {
            "format": FORMAT,
            "description": description,
            "entries": [self.entries[k].to_dict() for k in sorted(self.entries)],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], origin: str = "<data>") -> "ThresholdTable":
        """Parse file content; raises ThresholdsError naming `origin` on a bad format or entry."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ThresholdsError(f"{origin}: not a thresholds file (expected \"format\": \"{FORMAT}\")")
        entries: dict[TableKey, ThresholdEntry] = {}
        for i, raw in enumerate(data.get("entries", [])):
            try:
                entry = ThresholdEntry.from_dict(raw)
            except (KeyError, ValueError, TypeError) as exc:
                raise ThresholdsError(f"{origin}: entry {i} is malformed: {type(exc).__name__}: {exc}") from None
            entries[entry.key()] = entry
        return cls(entries)


def read_table(path: str | os.PathLike) -> ThresholdTable:
    """Read one thresholds file; raises ThresholdsError naming the file if it is missing or bad."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ThresholdsError(f"cannot read thresholds file {path}: {exc}") from None
    return ThresholdTable.from_json(data, str(path))


def write_table(table: ThresholdTable, path: str | os.PathLike, description: str = "") -> None:
    """Write `table` to `path` in the thresholds file format."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(table.to_json(description), f, indent=2)
        f.write("\n")


def load_thresholds(path: str | os.PathLike | None = None, environ: Mapping[str, str] = os.environ) -> ThresholdTable:
    """The default table merged with the override file (`path`, else $FXFUSE_THRESHOLDS, if set)."""
    table = read_table(DEFAULT_PATH)
    override = path if path is not None else env_setting(ENV_THRESHOLDS, environ)
    if override is not None:
        table = table.merged(read_table(override))
    return table


@functools.cache
def current_thresholds() -> ThresholdTable:
    """This process's table: the default file merged with $FXFUSE_THRESHOLDS (read once)."""
    return load_thresholds()
