"""Where checkpoint tensors come from: a Hugging Face safetensors directory or an in-memory dict.

A `TensorSource` answers, without reading any tensor data, which tensors exist and their full
shapes and dtypes; `read(name, slices)` then returns just the requested slice (one rank's shard),
so no process ever copies a whole tensor it only holds a part of. Problems found while opening a
checkpoint are raised together as one `CheckpointError`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Protocol

import torch
from safetensors import safe_open

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: How many problems a `CheckpointError` message lists before summarizing the rest as a count.
MAX_LISTED_PROBLEMS = 10

#: safetensors header dtype names -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message lists every problem found (first few + count)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        listed = "\n".join(f"  - {p}" for p in self.problems[:MAX_LISTED_PROBLEMS])
        more = len(self.problems) - MAX_LISTED_PROBLEMS
        suffix = f"\n  ... and {more} more problem(s)" if more > 0 else ""
        super().__init__(f"checkpoint cannot be loaded ({len(self.problems)} problem(s)):\n{listed}{suffix}")


class TensorSource(Protocol):
    """Read access to a checkpoint's tensors by name; metadata is free, data is read slice by slice."""

    #: The checkpoint's config.json contents (empty when there is none), e.g. `quantization_config`.
    config: Mapping[str, Any]

    def keys(self) -> list[str]:
        """Names of every tensor in the checkpoint."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name`."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor `name`."""
        ...

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The part of tensor `name` selected by one slice per dimension (on CPU, stored dtype)."""
        ...


class DictSource:
    """A `TensorSource` over an in-memory state dict (full, unsharded tensors in HF naming)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None = None):
        self.tensors = dict(state_dict)
        self.config = dict(config or {})

    def keys(self) -> list[str]:
        """Names of every tensor in the dict."""
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name`."""
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of tensor `name`."""
        return self.tensors[name].dtype

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """A view of the selected part of tensor `name`."""
        return self.tensors[name][slices]


class SafetensorsSource:
    """A `TensorSource` over a Hugging Face checkpoint directory.

    The directory holds `config.json` and either `model.safetensors` or a sharded
    `model.safetensors.index.json` whose `weight_map` names the file of every tensor. Opening
    reads only file headers; a missing config, index or file, an unreadable or corrupt file, or an
    index entry its file does not contain raises `CheckpointError` listing all of them.
    Use as a context manager (or call `close`) to release the open files.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        problems: list[str] = []
        self._handles: dict[str, Any] = {}
        self.config = self._read_json(CONFIG_FILE, problems)
        self._file_of = self._tensor_files(problems)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for file in sorted(set(self._file_of.values())):
            self._open(file, problems)
        for name, file in self._file_of.items():
            if file in self._handles:
                self._read_header(name, file, problems)
        if problems:
            self.close()
            raise CheckpointError(problems)

    def _read_json(self, filename: str, problems: list[str]) -> dict[str, Any]:
        path = os.path.join(self.directory, filename)
        if not os.path.isfile(path):
            problems.append(f"missing {filename} in checkpoint directory {self.directory}")
            return {}
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"cannot read {path}: {exc}")
            return {}

    def _tensor_files(self, problems: list[str]) -> dict[str, str]:
        """Tensor name -> file name, from the index if there is one, else from the single file."""
        if os.path.isfile(os.path.join(self.directory, INDEX_FILE)):
            weight_map = self._read_json(INDEX_FILE, problems).get("weight_map")
            if not isinstance(weight_map, dict):
                problems.append(f"{INDEX_FILE} in {self.directory} has no 'weight_map' object")
                return {}
            return dict(weight_map)
        if not os.path.isfile(os.path.join(self.directory, SINGLE_FILE)):
            problems.append(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {self.directory}")
            return {}
        self._open(SINGLE_FILE, problems)
        if SINGLE_FILE not in self._handles:
            return {}
        return {name: SINGLE_FILE for name in self._handles[SINGLE_FILE].keys()}

    def _open(self, file: str, problems: list[str]) -> None:
        if file in self._handles:
            return
        path = os.path.join(self.directory, file)
        if not os.path.isfile(path):
            problems.append(f"missing file {file} (named in {INDEX_FILE}) in {self.directory}")
            return
        try:
            handle = safe_open(path, framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors raises several error types for bad files
            problems.append(f"cannot read safetensors file {path}: {exc}")
            return
        self._handles[file] = handle

    def _read_header(self, name: str, file: str, problems: list[str]) -> None:
        handle = self._handles[file]
        try:
            tensor_slice = handle.get_slice(name)
        except Exception:  # noqa: BLE001 - a name the file does not hold
            problems.append(f"tensor {name}: {INDEX_FILE} maps it to {file}, which does not contain it")
            return
        stored = tensor_slice.get_dtype()
        if stored not in SAFETENSORS_DTYPES:
            problems.append(f"tensor {name} in {file}: unsupported dtype {stored}")
            return
        self._shapes[name] = tuple(tensor_slice.get_shape())
        self._dtypes[name] = SAFETENSORS_DTYPES[stored]

    def keys(self) -> list[str]:
        """Names of every tensor in the checkpoint."""
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name` (from the file header)."""
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor `name` (from the file header)."""
        return self._dtypes[name]

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Read only the selected part of tensor `name` from its file."""
        return self._handles[self._file_of[name]].get_slice(name)[slices]

    def close(self) -> None:
        """Release the open files; the source cannot read afterwards."""
        self._handles.clear()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: Where multimodal wrappers (Kimi-K2.5's KimiK25ForConditionalGeneration) keep the text model's tensors.
TEXT_MODEL_PREFIX = "language_model."


class PrefixedSource:
    """The tensors of `source` under `prefix`, named without it (a multimodal checkpoint's text model).

    Tensors outside the prefix (a vision tower, a projector) are not visible; `hidden` counts them.
    """

    def __init__(self, source: TensorSource, prefix: str):
        self.source, self.prefix = source, prefix
        self.config = source.config
        names = source.keys()
        self._keys = [name[len(prefix):] for name in names if name.startswith(prefix)]
        self.hidden = len(names) - len(self._keys)

    def keys(self) -> list[str]:
        """Names of the text model's tensors, without the prefix."""
        return list(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name`."""
        return self.source.shape(self.prefix + name)

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor `name`."""
        return self.source.dtype(self.prefix + name)

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The selected part of tensor `name`."""
        return self.source.read(self.prefix + name, slices)


def text_model_source(source: TensorSource) -> TensorSource:
    """`source` itself, or its `language_model.` part when the text model's tensors live there."""
    if isinstance(source, PrefixedSource):
        return source
    names = source.keys()
    if any(name.startswith(TEXT_MODEL_PREFIX + "model.") for name in names) and not any(name.startswith("model.") for name in names):
        return PrefixedSource(source, TEXT_MODEL_PREFIX)
    return source
