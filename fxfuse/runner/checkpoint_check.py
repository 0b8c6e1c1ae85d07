"""A checkpoint checked from its file headers in the launching process, before any rank starts.

`check_checkpoint(directory, config, tp, dtype, quant)` opens the checkpoint's safetensors files (their
headers only, so a missing, truncated or corrupt file is found here, not by every rank after start-up)
and matches every tensor against the model's parameters at this tensor-parallel size and weight format
(`fxfuse.models.weights.plan_loads` on rank 0's shard built on the meta device: missing or unexpected
tensors, shapes, splits, quantized layouts). It reads no tensor data and raises RunError listing the
problems on one line.
"""

from __future__ import annotations

import torch

from fxfuse.models.config import ModelConfig
from fxfuse.models.quant.scheme import QuantScheme
from fxfuse.models.tensor_sources import CheckpointError, SafetensorsSource
from fxfuse.models.weights import plan_loads
from fxfuse.runner.errors import RunError
from fxfuse.runner.memory_plan import meta_context, meta_model

#: How many of a checkpoint's problems the one-line error names before counting the rest.
LISTED_PROBLEMS = 3


def check_checkpoint(directory: str, config: ModelConfig, tp: int, dtype: torch.dtype, quant: QuantScheme) -> None:
    """Raise RunError unless every rank can load its shard of `directory` into the model `config`
    describes at size `tp` (checked from metadata: no tensor data is read)."""
    try:
        with SafetensorsSource(directory) as source:
            plan_loads(meta_model(config, tp, dtype, quant), source, meta_context(tp))
    except CheckpointError as exc:
        listed = "; ".join(exc.problems[:LISTED_PROBLEMS])
        more = len(exc.problems) - LISTED_PROBLEMS
        raise RunError(f"checkpoint {directory} cannot be loaded: {listed}" + (f"; and {more} more problem(s)" if more > 0 else "")) from None
