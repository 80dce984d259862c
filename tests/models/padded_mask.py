"""A user's attention over a padded batch whose additive mask is ``(1 - keep) * torch.finfo(torch.float32).min`` in
the compute dtype, as ``transformers`` once built it: finite in fp32, ``-inf`` in fp16.  Sequence 1 is padding
throughout, so in fp16 its every score is ``-inf`` and its softmax row NaN; the fp32 run is finite."""

import math

import torch
from torch import nn


class PadMask(nn.Module):
    def forward(self, keep, dtype):
        return (1.0 - keep[:, None, None, :].to(dtype)) * torch.finfo(torch.float32).min


class PaddedAttention(nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.pad_mask, self.heads, self.norm = PadMask(), heads, nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        keep = torch.ones(b, t, dtype=torch.long, device=x.device)
        keep[0, -3:] = 0
        keep[1] = 0
        bias = self.pad_mask(keep, x.dtype)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        s = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        a = (torch.softmax(s, -1) @ split(self.v(x))).transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.o(a))


def build():
    torch.manual_seed(0)
    return PaddedAttention()


def inputs():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
