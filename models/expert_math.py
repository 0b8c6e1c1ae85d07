"""Routed-expert arithmetic shared by the bf16 experts and the dequantizing reference of quantized ones.

`dense_experts` runs every expert on every token and combines with zero weights for unchosen experts
(simple, exact, fixed shapes); `grouped_experts` sorts the (token, expert) rows by expert and uses
`torch._grouped_mm` (bf16 on CUDA), work proportional to the chosen experts. Both return this rank's
partial output [N, hidden] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [N, H], ids / fp32 weights [N, k], gate/up [E, I, H], down [E, H, I] -> [N, H]."""
    combine = torch.zeros(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device)
    combine = combine.scatter(1, expert_ids, weights)
    gate_out = torch.einsum("nh,eih->eni", x, gate)
    up_out = torch.einsum("nh,eih->eni", x, up)
    out = torch.einsum("eni,ehi->enh", F.silu(gate_out) * up_out, down)
    return torch.einsum("enh,ne->nh", out.float(), combine).to(x.dtype)


def sort_rows_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token of each sorted row, rows per expert int32 [E]) of the flattened (token, slot) rows."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    rows_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=expert_ids.device)
    rows_per_expert = rows_per_expert.scatter_add(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    return order, order // top_k, rows_per_expert


def combine_rows(rows_out: torch.Tensor, order: torch.Tensor, token_of_row: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """Sum the sorted rows' outputs [R, H] into their tokens, each times its routing weight (float32 [N, H])."""
    out = rows_out.float() * weights.reshape(-1)[order].unsqueeze(1)
    combined = torch.zeros(tokens, rows_out.shape[1], dtype=torch.float32, device=rows_out.device)
    return combined.index_add(0, token_of_row, out)


def grouped_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Same as `dense_experts`, with `torch._grouped_mm` over the rows sorted by expert (bf16 only)."""
    order, token_of_row, rows_per_expert = sort_rows_by_expert(expert_ids, gate.shape[0])
    group_ends = torch.cumsum(rows_per_expert, dim=0, dtype=torch.int32)
    rows = x[token_of_row]
    gate_out = torch._grouped_mm(rows, gate.transpose(1, 2), offs=group_ends)
    up_out = torch._grouped_mm(rows, up.transpose(1, 2), offs=group_ends)
    out = torch._grouped_mm(F.silu(gate_out) * up_out, down.transpose(1, 2), offs=group_ends)
    return combine_rows(out, order, token_of_row, weights, x.shape[0]).to(x.dtype)
