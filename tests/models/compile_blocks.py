"""A stack of small residual blocks in bf16, where torch.compile's fused kernels (fp32 intermediates) and eager
code (rounding after every op) give different numbers: for eager-vs-compiled sessions."""

import torch


class Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.l = torch.nn.Linear(d, d)
        self.n = torch.nn.LayerNorm(d)

    def forward(self, x):
        return torch.nn.functional.gelu(self.n(self.l(x))) * 3 + x


class Blocks(torch.nn.Module):
    def __init__(self, n=2, d=32):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build():
    torch.manual_seed(0)
    return Blocks()


def inputs():
    torch.manual_seed(1)
    return torch.randn(8, 32)
