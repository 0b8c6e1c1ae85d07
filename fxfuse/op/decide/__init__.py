"""Which implementation of the fused op runs a call, decided from values every rank agrees on.

The decision table (`policy`) with its inputs: the implementations (`modes`), the FXFUSE_* settings
(`settings`, `environment`), the measured thresholds (`thresholds`, `default_thresholds.json`), the
FlashInfer version gates (`flashinfer_version`), the GPU links (`topology`), and the per-group
agreement that makes them equal on every rank (`agreement`, `group_config`); `capability` answers at
compile time whether any fused kernel can ever run a site.
"""
