"""A user's model with an intended -inf: a causal attention that masks its scores with masked_fill(-inf)
(in every run, fp32 included), then an MLP whose down projection overflows fp16 (weights scaled by 1e5)."""

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        t = x.shape[1]
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
        x = x + torch.softmax(s, -1) @ self.v(x)
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build():
    torch.manual_seed(0)
    m = Model()
    with torch.no_grad():
        m.blocks[1].down.weight.mul_(1e5)
    return m


def inputs():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
