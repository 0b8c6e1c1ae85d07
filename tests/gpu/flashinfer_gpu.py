"""Skip markers shared by the GPU tests: a CUDA GPU of an architecture FlashInfer's all-reduce
fusion kernel is built for, and flashinfer-python installed."""

import importlib.util

import pytest
import torch

FLASHINFER_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python >= 0.6.3"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] not in (9, 10),
        reason="FlashInfer's all-reduce fusion kernel is built for SM 9.x and 10.x only",
    ),
]
