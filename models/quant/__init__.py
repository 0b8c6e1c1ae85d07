"""Quantized weights kept in their checkpoint precision: FP8 block-scaled (DeepSeek-V3) and INT4
group-packed routed experts (Kimi-K2.5, compressed-tensors `pack-quantized`), and the GEMMs that use
them directly (registered torch ops with fake kernels; Triton or cuBLAS on CUDA, a dequantizing
reference on CPU)."""
