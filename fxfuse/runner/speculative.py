"""Greedy speculative-decoding bookkeeping for multi-token verify steps.

A verify step feeds `[last_token, draft_1, ..., draft_{T-1}]` and gets the model's greedy
prediction at each of the T positions. The longest prefix of drafts that matches the predictions
is accepted, plus one bonus token, so the generated sequence is exactly what one-token-at-a-time
greedy decoding would give, whatever the drafts are. The drafts for the next step are the
predictions this step made beyond the accepted prefix (a free "self-draft").
"""

from __future__ import annotations

import torch


def accepted_length(drafts: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """Per sequence, how many leading drafts equal the model's predictions.

    drafts: [B, T-1] tokens fed after the last accepted token; predicted: [B, T] greedy tokens.
    Returns [B] int64 counts in 0..T-1.
    """
    matches = (drafts == predicted[:, : drafts.shape[1]]).to(torch.int64)
    return matches.cumprod(dim=1).sum(dim=1)


def next_drafts(predicted: torch.Tensor, accepted: torch.Tensor, width: int) -> torch.Tensor:
    """Drafts for the next step: this step's predictions after the bonus token, padded by repetition.

    predicted: [B, T]; accepted: [B]; returns [B, width - 1].
    """
    batch, steps = predicted.shape
    offsets = accepted.unsqueeze(1) + 1 + torch.arange(width - 1).unsqueeze(0)
    return predicted.gather(1, offsets.clamp(max=steps - 1))
