"""Session set-up shared by every test: on a machine without CUDA, Triton kernels run in Triton's CPU
interpreter. The variable must be set before the first `triton.jit` runs (Triton decides per kernel
when it is decorated), so it is set here, before any test module imports a kernel."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
