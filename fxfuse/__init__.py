"""fxfuse: a torch.compile backend that fuses tensor-parallel all_reduce -> residual add -> RMSNorm.

`torch.compile(model, backend="fxfuse")` runs the fusion passes on the post-grad ATen graph and
hands the result to Inductor (or eager); `fxfuse.post_grad_pass()` gives the same passes to a compile
whose backend is not fxfuse (Inductor's `post_grad_custom_post_pass`). The compiler side lives here;
`fxfuse.passes` holds the graph passes and `fxfuse.models` a reference tensor-parallel DeepSeek-V3.
"""

__version__ = "0.1.0"

#: Public names loaded on first access, so `import fxfuse` never imports CUDA code or FlashInfer.
_LAZY_EXPORTS = {
    "prepare": "fxfuse.op.runtime.prepare",
    "destroy_workspaces": "fxfuse.op.runtime.prepare",
    "post_grad_pass": "fxfuse.post_grad",
}


def __getattr__(name: str):
    """Resolve the lazily exported names (`fxfuse.prepare`, `fxfuse.destroy_workspaces`,
    `fxfuse.post_grad_pass`)."""
    if name in _LAZY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'fxfuse' has no attribute {name!r}")
