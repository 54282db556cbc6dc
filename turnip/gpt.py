"""A small GPT: token + position embeddings, causal SDPA attention, LayerNorm, GELU MLP, tied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    lora_rank: int = 0  # >0: low-rank adapters on attention and MLP projections


class LoRALinear(nn.Module):
    """A frozen base projection plus a trainable low-rank update (Hu et al., 2021)."""

    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / d_in**0.5)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.01)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _linear(d_in: int, d_out: int, rank: int) -> nn.Module:
    return LoRALinear(d_in, d_out, rank) if rank > 0 else nn.Linear(d_in, d_out)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = _linear(cfg.d_model, 3 * cfg.d_model, cfg.lora_rank)
        self.proj = _linear(cfg.d_model, cfg.d_model, cfg.lora_rank)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = _linear(cfg.d_model, 4 * cfg.d_model, cfg.lora_rank)
        self.fc_out = _linear(4 * cfg.d_model, cfg.d_model, cfg.lora_rank)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        if cfg.lora_rank > 0:  # LoRA fine-tuning: only adapters train
            for name, p in self.named_parameters():
                p.requires_grad_("lora_" in name)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token cross-entropy; batch = (input ids, target ids)."""
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def example_batch(cfg: GPTConfig, batch: int = 2, device="cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
