"""What the fusion pass makes of a model: the per-site report behind `fxfuse report` (`site_report`)
and for any compiled function or module (`compiled_report`)."""
