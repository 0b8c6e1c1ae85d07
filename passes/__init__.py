"""Graph passes of fxfuse (shipped as `fxfuse.passes`): one file per pass, each with one entry point
that rewrites a post-grad FX graph in place and returns how many sites it rewrote."""
