"""The reference model of fxfuse (shipped as `fxfuse.models`): tensor-parallel layers, a DeepSeek-V3
implementation that matches transformers, presets, and its checkpoint loader."""
