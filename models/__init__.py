"""Reference models of fxfuse (shipped as `fxfuse.models`): tensor-parallel layers, a DeepSeek-V3
implementation that matches transformers, its checkpoint loader, presets and the model runner."""
