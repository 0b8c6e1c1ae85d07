"""Greedy speculative-verify bookkeeping: acceptance counts and next drafts."""

import torch

from fxfuse.runner.speculative import accepted_length, next_drafts


def test_accepted_length_counts_leading_matches_only():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    predicted = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 0, 8]])
    assert accepted_length(drafts, predicted).tolist() == [3, 1, 0, 2]


def test_accepted_length_with_no_drafts_is_zero():
    predicted = torch.tensor([[3], [4]])
    assert accepted_length(predicted[:, :0], predicted).tolist() == [0, 0]


def test_next_drafts_continue_after_bonus_token_and_pad_by_repeating():
    predicted = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    accepted = torch.tensor([0, 2])
    # sequence 0 accepted nothing: bonus is 10, drafts continue with 11, 12, 13
    # sequence 1 accepted 2: bonus is 22, drafts are 23 then repeats of the last prediction
    assert next_drafts(predicted, accepted, width=4).tolist() == [[11, 12, 13], [23, 23, 23]]
