"""What the fusion pass did: graph snapshots and diffs (`graph_diff`) and the per-site report
behind `fxfuse report` (`site_report`)."""
