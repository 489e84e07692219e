"""GPT-MoE: shardc's own plain-PyTorch definition of the paper's GPT-MoE workloads.

The paper publishes no configuration; shardc defines (see REFERENCE.md): hidden 12288,
96 heads of 128 with full multi-head attention, one MoE block per layer with 16 GeLU experts
of two matrices each (ffn 49152), top-2 routing, vocab 51200, untied embedding and LM head.
Positions are rotary (no parameters), norms are pre-norm LayerNorm (weight + bias), linears
have no bias. 60 layers = 1.197e12 parameters, 80 layers = 1.596e12.

This module is deliberately *not* an HF class, so the frontend is exercised on a
user-written model: a fused ``qkv`` linear, experts as stacked ``[E, in, out]`` weights
multiplied by the custom op ``gpt_moe::grouped_mm`` (``F.grouped_mm`` in bf16, a loop
over experts otherwise; it exports without data-dependent shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTMoEConfig:
    vocab_size: int = 51200
    hidden_size: int = 12288
    num_layers: int = 60
    num_heads: int = 96
    head_dim: int = 128
    ffn_size: int = 49152
    num_experts: int = 16
    top_k: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary position embedding; x is [batch, heads, seq, head_dim]."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    pos = torch.arange(seq, device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    cos = torch.cat([angles, angles], dim=-1).cos().to(x.dtype)
    sin = torch.cat([angles, angles], dim=-1).sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.theta = cfg.num_heads, cfg.head_dim, cfg.rope_theta
        inner = cfg.num_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.out = nn.Linear(inner, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rotary(q, self.theta), _rotary(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


@torch.library.custom_op("gpt_moe::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [S, in] grouped by expert (group e = rows offsets[e-1]:offsets[e]), weight
    [E, in, out] -> [S, out]. bf16 uses ``F.grouped_mm``; other dtypes loop over experts."""
    if rows.dtype == torch.bfloat16 and rows.device.type != "meta":
        return F.grouped_mm(rows, weight, offs=offsets)
    out = rows.new_zeros(rows.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weight[e]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(rows, weight, offsets):
    return rows.new_empty(rows.shape[0], weight.shape[-1])


class Experts(nn.Module):
    """``num_experts`` GeLU MLPs stored stacked: w_in [E, hidden, ffn], w_out [E, ffn, hidden]."""

    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.ffn_size
        self.num_experts = e
        self.w_in = nn.Parameter(torch.empty(e, h, f))
        self.w_out = nn.Parameter(torch.empty(e, f, h))
        for w, fan_in in ((self.w_in, h), (self.w_out, f)):
            if w.device.type != "meta":
                nn.init.normal_(w, std=1.0 / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
        """x [T, hidden]; expert_ids, weights [T, top_k] -> [T, hidden]."""
        tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        rows = x[order // top_k]  # one row per (token, choice), grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts = counts.scatter_add(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        hidden = F.gelu(grouped_mm(rows, self.w_in, offsets))
        out = grouped_mm(hidden, self.w_out, offsets)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(out).index_copy(0, order, out)
        return combined.view(tokens, top_k, -1).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, ids, weights).view(b, s, h)


class Block(nn.Module):
    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_moe = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.moe(self.ln_moe(x))


class GPTMoE(nn.Module):
    """Decoder-only GPT with an MoE block in every layer: input_ids [B, S] -> logits [B, S, V]."""

    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def build(cfg: GPTMoEConfig, device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> GPTMoE:
    """Build on ``device`` (``meta`` for full size: no memory is allocated)."""
    with torch.device(device):
        model = GPTMoE(cfg)
    return model.to(dtype)


def tiny_config(num_layers: int = 2) -> GPTMoEConfig:
    """Same architecture, CPU-sized: hidden 64, 8 heads of 8, 4 experts of ffn 128, vocab 256."""
    return GPTMoEConfig(vocab_size=256, hidden_size=64, num_layers=num_layers, num_heads=8,
                        head_dim=8, ffn_size=128, num_experts=4, top_k=2)


def tiny(num_layers: int = 2, seed: int = 0) -> GPTMoE:
    """Tiny GPT-MoE with deterministic float32 CPU weights."""
    torch.manual_seed(seed)
    return build(tiny_config(num_layers), device="cpu", dtype=torch.float32).eval()


def example_ids(vocab: int, batch: int = 1, seq: int = 16) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64),)
