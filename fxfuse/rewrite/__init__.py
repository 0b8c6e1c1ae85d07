"""One run of fxfuse's passes on a post-grad graph and what it did: the ground both compile entry
points (`fxfuse.backend`, `fxfuse.post_grad`) stand on.

`recorder.FusionRecorder` runs the passes and keeps a `CompileRecord` per graph (`records`: stats, and
the marks that carry them across Inductor's cache hits; `graph_diff`: the graph before and after as
text); `sites` says what became of each all-reduce site, and why one was not fused; `log` says it
through Python logging (the `fxfuse` component: a warning per graph that keeps sites unfused,
`TORCH_LOGS=fxfuse` for every site). This package imports neither entry point, nor anything above
them.
"""
