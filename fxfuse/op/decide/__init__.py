"""Which implementation of the fused op runs a call, decided from values every rank agrees on.

The decision table (`policy.decide`, pure, tested branch by branch) with its inputs: the implementations
(`modes`), the FXFUSE_* settings (`settings`, each read with `environment.env_setting`), the measured
thresholds (`thresholds`, `default_thresholds.json`), the FlashInfer version gates (`flashinfer_version`,
from package metadata: FlashInfer itself is never imported here), the GPU links (`topology`), and the
per-group agreement that makes all of them equal on every rank (`agreement`, `group_config`);
`call_decision` turns one call shape into the table's question and its answer, and `capability` is the
compile-time question (can any fused kernel ever run this site?), from graph facts only. May import the
op's contract (`fxfuse.op.schema`, `fp8_schema`, `fp8_recipe`, `reference`) and nothing else of fxfuse:
never the kernels or the runtime, so a decision never depends on what this process happens to have
built or allocated except through the arguments it is given.
"""
