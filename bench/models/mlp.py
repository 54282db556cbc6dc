"""A small MLP classifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10, depth: int = 3, dropout: float = 0.0):
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(F.gelu(layer(x)))
        return self.out(x)


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def example_batch(d_in: int = 32, d_out: int = 10, batch: int = 8, device="cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=gen).to(device), torch.randint(0, d_out, (batch,), generator=gen).to(device)
