"""fxfuse: a torch.compile backend that fuses tensor-parallel all_reduce -> residual add -> RMSNorm.

`torch.compile(model, backend="fxfuse")` runs the fusion passes on the post-grad ATen graph and
hands the result to Inductor (or eager). The compiler side lives here; `fxfuse.passes` holds the
graph passes and `fxfuse.models` a reference tensor-parallel DeepSeek-V3.
"""

__version__ = "0.1.0"
