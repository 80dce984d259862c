"""A user's attention over a padded batch whose additive mask is ``(1 - keep) * torch.finfo(torch.float32).min`` in
the compute dtype, as ``transformers`` once built it: finite in fp32, ``-inf`` in fp16.  Sequence 1 is padding
throughout, so in fp16 its every score is ``-inf`` and its softmax row NaN; the fp32 run is finite.  The model is
the localization bench's own (``bench/localization_cases.py``: ``PaddedAttention``)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from localization_cases import PaddedAttention  # noqa: E402


def build():
    torch.manual_seed(0)
    return PaddedAttention()


def inputs():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
