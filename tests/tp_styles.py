"""Tiny tensor-parallel models written the way two well-known codebases write them, for the fusion tests.

Written for these tests after reading how gpt-fast and DeepSeek-V3's official inference code are
structured (no code taken from them); what matters is what reaches the graph:
- `GptFastStyle`: RMSNorm as `x * rsqrt(mean(x * x) + eps)` on `x.float()`, `type_as`, `output *
  weight`; tensor parallelism applied afterwards by slicing weights and registering forward hooks that
  `funcol.all_reduce` the outputs of the row-parallel `wo` and `w2`.
- `DeepSeekOfficialStyle`: vocab-parallel embedding and row-parallel linears that reduce in place
  with `dist.all_reduce`, `F.rms_norm`, and an MoE whose routed experts' sum is all-reduced in place and
  added to the shared experts' (separately all-reduced) output as `(y + z).view(shape)`. The official
  code runs each local expert on the tokens routed to it (data-dependent shapes, host syncs); here every
  local expert runs on all tokens, weighted by the routing weight (zero when not routed), so the model
  compiles as one graph with the same all-reduce structure.
Both build the full model from a seed on every rank and keep this rank's slices, so they equal the
unsharded model up to summation order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def _slice(weight: torch.Tensor, dim: int, rank: int, world: int) -> nn.Parameter:
    return nn.Parameter(weight.chunk(world, dim=dim)[rank].clone(), requires_grad=False)


def _causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ---------------------------------------------------------------- gpt-fast style


class GptFastRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class GptFastAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.dim = n_head, dim // n_head, dim
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([self.dim, self.dim, self.dim], dim=-1)
        q, k, v = (t.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = _causal_attention(q, k, v).transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class GptFastFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GptFastBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.attention = GptFastAttention(dim, n_head)
        self.feed_forward = GptFastFeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = GptFastRMSNorm(dim), GptFastRMSNorm(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class GptFastStyle(nn.Module):
    """Embedding, `layers` blocks, final norm, output projection (embedding and output replicated)."""

    def __init__(self, vocab: int = 128, dim: int = 64, n_head: int = 4, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([GptFastBlock(dim, n_head, hidden) for _ in range(layers)])
        self.norm = GptFastRMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        for norm in [self.norm] + [n for b in self.layers for n in (b.attention_norm, b.ffn_norm)]:
            nn.init.normal_(norm.weight, 1.0, 0.1)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def apply_gpt_fast_tp(model: GptFastStyle, rank: int, world: int, group: dist.ProcessGroup) -> GptFastStyle:
    """Shard heads and the MLP's hidden size over `world` ranks; all-reduce `wo` and `w2` with hooks."""
    for block in model.layers:
        attn, ffn = block.attention, block.feed_forward
        q, k, v = attn.wqkv.weight.split([attn.dim] * 3, dim=0)
        attn.wqkv.weight = nn.Parameter(torch.cat([_slice(t, 0, rank, world) for t in (q, k, v)]), requires_grad=False)
        attn.wo.weight = _slice(attn.wo.weight, 1, rank, world)
        attn.n_head, attn.dim = attn.n_head // world, attn.dim // world
        ffn.w1.weight, ffn.w3.weight = _slice(ffn.w1.weight, 0, rank, world), _slice(ffn.w3.weight, 0, rank, world)
        ffn.w2.weight = _slice(ffn.w2.weight, 1, rank, world)
        for row_parallel in (attn.wo, ffn.w2):
            row_parallel.register_forward_hook(lambda _module, _input, output: funcol.all_reduce(output, "sum", group))
    return model


# ---------------------------------------------------------------- DeepSeek official style


class ParallelEmbedding(nn.Module):
    """This rank's slice of the vocabulary; out-of-range tokens look up zeros; partial rows summed in place."""

    def __init__(self, weight: torch.Tensor, rank: int, world: int, group) -> None:
        super().__init__()
        part = weight.shape[0] // world
        self.start, self.end, self.group = rank * part, (rank + 1) * part, group
        self.weight = _slice(weight, 0, rank, world)

    def forward(self, x):
        mask = (x < self.start) | (x >= self.end)
        x = x - self.start
        x[mask] = 0
        y = F.embedding(x, self.weight)
        y[mask] = 0
        dist.all_reduce(y, group=self.group)
        return y


class RowParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, rank: int, world: int, group) -> None:
        super().__init__()
        self.weight, self.group = _slice(weight, 1, rank, world), group

    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class DeepSeekRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim), requires_grad=False)

    def forward(self, x):
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class DeepSeekAttention(nn.Module):
    """Plain multi-head attention (the official code has MLA): column-parallel heads, row-parallel wo."""

    def __init__(self, dim: int, n_heads: int, rank: int, world: int, group) -> None:
        super().__init__()
        self.local_heads, self.head_dim = n_heads // world, dim // n_heads
        full_q, full_kv = nn.Linear(dim, dim, bias=False).weight, nn.Linear(dim, 2 * dim, bias=False).weight
        self.wq = _slice(full_q, 0, rank, world)
        k, v = full_kv.chunk(2, dim=0)
        self.wkv = nn.Parameter(torch.cat([_slice(k, 0, rank, world), _slice(v, 0, rank, world)]), requires_grad=False)
        self.wo = RowParallelLinear(nn.Linear(dim, dim, bias=False).weight, rank, world, group)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = F.linear(x, self.wq).view(bsz, seqlen, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = F.linear(x, self.wkv).view(bsz, seqlen, 2 * self.local_heads, self.head_dim).transpose(1, 2).chunk(2, 1)
        y = _causal_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.wo(y)


class DeepSeekMLP(nn.Module):
    """Column-parallel w1/w3, row-parallel w2 (which all-reduces)."""

    def __init__(self, dim: int, inter: int, rank: int, world: int, group) -> None:
        super().__init__()
        self.w1 = _slice(nn.Linear(dim, inter, bias=False).weight, 0, rank, world)
        self.w3 = _slice(nn.Linear(dim, inter, bias=False).weight, 0, rank, world)
        self.w2 = RowParallelLinear(nn.Linear(inter, dim, bias=False).weight, rank, world, group)

    def forward(self, x):
        return self.w2(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3))


class DeepSeekExpert(nn.Module):
    """One routed expert, whole on the rank that owns it."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, inter, bias=False), nn.Linear(inter, dim, bias=False), \
            nn.Linear(dim, inter, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DeepSeekMoE(nn.Module):
    """Routed experts split across ranks (expert parallel) and shared experts (tensor parallel)."""

    def __init__(self, dim: int, inter: int, n_experts: int, top_k: int, rank: int, world: int, group) -> None:
        super().__init__()
        self.dim, self.top_k, self.group = dim, top_k, group
        self.gate = nn.Parameter(torch.randn(n_experts, dim) / dim**0.5, requires_grad=False)
        experts = [DeepSeekExpert(dim, inter) for _ in range(n_experts)]
        per_rank = n_experts // world
        self.first = rank * per_rank
        self.experts = nn.ModuleList(experts[self.first : self.first + per_rank])
        self.shared_experts = DeepSeekMLP(dim, 2 * inter, rank, world, group)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.dim)
        scores = F.linear(x, self.gate).softmax(dim=-1)
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        y = torch.zeros_like(x)
        for offset, expert in enumerate(self.experts):
            routed = ((indices == self.first + offset) * weights).sum(dim=-1, keepdim=True)
            y = y + expert(x) * routed
        z = self.shared_experts(x)
        dist.all_reduce(y, group=self.group)
        return (y + z).view(shape)


class DeepSeekBlock(nn.Module):
    def __init__(self, dim, n_heads, inter, moe: bool, rank, world, group) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = DeepSeekRMSNorm(dim), DeepSeekRMSNorm(dim)
        self.attn = DeepSeekAttention(dim, n_heads, rank, world, group)
        self.ffn = (DeepSeekMoE(dim, inter // 4, 4, 2, rank, world, group) if moe
                    else DeepSeekMLP(dim, inter, rank, world, group))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class DeepSeekOfficialStyle(nn.Module):
    """Vocab-parallel embedding, a dense layer, an MoE layer, final norm, replicated head."""

    def __init__(self, rank: int, world: int, group, vocab: int = 128, dim: int = 64, n_heads: int = 4,
                 inter: int = 128) -> None:
        super().__init__()
        self.embed = ParallelEmbedding(nn.Embedding(vocab, dim).weight, rank, world, group)
        self.layers = nn.ModuleList([DeepSeekBlock(dim, n_heads, inter, moe, rank, world, group) for moe in (False, True)])
        self.norm = DeepSeekRMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
