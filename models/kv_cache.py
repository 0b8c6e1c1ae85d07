"""Static MLA cache for one attention layer: compressed KV latent and rotary key per position.

MLA caches what every head shares: the latent after `kv_a_layernorm` [kv_lora_rank] and the
roped key [qk_rope_head_dim]. The buffers have fixed shape [max_batch, max_seq_len, width];
a step writes its tokens at their positions in place, so the same tensors serve prefill and
decode and a captured CUDA graph keeps pointing at them.
"""

from __future__ import annotations

import torch
from torch import nn


class MLACache(nn.Module):
    """Per-layer static cache of compressed latents and rotary keys, indexed by (batch row, position)."""

    def __init__(
        self, max_batch: int, max_seq_len: int, latent_dim: int, rope_dim: int, *, dtype: torch.dtype, device=None
    ) -> None:
        super().__init__()
        self.register_buffer("latent", torch.zeros(max_batch, max_seq_len, latent_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("rope_key", torch.zeros(max_batch, max_seq_len, rope_dim, dtype=dtype, device=device), persistent=False)

    def update(
        self, positions: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [B, T, ...] entries at `positions` [B, T]; return the cache views of rows 0..B-1.

        The returned tensors cover every position [B, max_seq_len, ...]; entries at positions not
        yet written are stale or zero and must be masked by the caller.
        """
        batch = positions.shape[0]
        rows = torch.arange(batch, device=positions.device).unsqueeze(1).expand_as(positions)
        self.latent.index_put_((rows, positions), latent)
        self.rope_key.index_put_((rows, positions), rope_key)
        return self.latent[:batch], self.rope_key[:batch]

    def reset(self) -> None:
        """Forget every cached position."""
        self.latent.zero_()
        self.rope_key.zero_()
