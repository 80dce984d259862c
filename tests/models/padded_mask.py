"""A user's model over a padded batch: an embedding, one attention whose additive mask is
``(1 - keep) * torch.finfo(torch.float32).min`` in the dtype of the hidden states it receives (as ``transformers``
once built it: finite in fp32, ``-inf`` in fp16), and a head.  Sequence 1 is padding throughout, so in fp16 its every
score is ``-inf`` and its softmax row NaN; the fp32 run is finite.  The attention is the localization bench's own
(``bench/localization_cases.py``: ``PaddedAttention``)."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from localization_cases import PaddedAttention  # noqa: E402


class PaddedLM(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.embed, self.layer, self.head = nn.Linear(d, d), PaddedAttention(d), nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)))


def build():
    torch.manual_seed(0)
    return PaddedLM()


def inputs():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
