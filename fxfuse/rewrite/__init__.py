"""What one run of fxfuse's passes on a post-grad graph did: the ground both compile entry points
(`fxfuse.backend`, `fxfuse.post_grad`) stand on.

`records` keeps a `CompileRecord` per graph (stats, and the marks that carry them across Inductor's
cache hits); `graph_diff` writes the graph before and after as text. This package imports neither
entry point, nor anything above them.
"""
