"""A magnitude histogram stored sparse: the bins that hold values and their counts.

One encoder and one decoder for the store, the shards, the JSON form of
``TensorStats`` and shared sessions; the decoder refuses what a dense
histogram over ``HIST_EDGES`` cannot be (other edges, bins out of range,
negative counts, bins and counts of different lengths, bins out of order or repeated).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .edges import HIST_EDGES_ID, N_BINS

__all__ = ["HistogramError", "encode_hist", "decode_hist"]


class HistogramError(ValueError):
    """A stored histogram cannot be read over this version's bin edges; the message says why."""


def encode_hist(hist) -> tuple[list[int], list[int]]:
    """(bins, counts) of the non-empty bins of a dense histogram."""
    h = np.asarray(hist)
    nz = np.flatnonzero(h)
    return nz.astype(np.int32).tolist(), h[nz].astype(np.int64).tolist()


def decode_hist(bins: Optional[Sequence[int]], counts: Optional[Sequence[int]], *,
                edges_id: Optional[str] = HIST_EDGES_ID) -> np.ndarray:
    """The dense int64 histogram of ``encode_hist``'s output; ``HistogramError`` says what is wrong."""
    if edges_id is not None and edges_id != HIST_EDGES_ID:
        raise HistogramError(f"it uses bin edges {edges_id}, this version uses {HIST_EDGES_ID}")
    try:
        b = np.asarray(bins if bins is not None else [], dtype=np.int64)
        c = np.asarray(counts if counts is not None else [], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise HistogramError("its bins or counts are not integers") from None
    if b.size and (b.min() < 0 or b.max() >= N_BINS):
        raise HistogramError(f"it has bins outside 0..{N_BINS - 1}")
    if b.ndim != 1 or b.shape != c.shape:
        raise HistogramError(f"it has {b.size} bins but {c.size} counts")
    if c.size and c.min() < 0:
        raise HistogramError("it has negative counts")
    if b.size > 1 and not (np.diff(b) > 0).all():  # encode_hist writes bins in increasing order
        raise HistogramError("its bins are not in increasing order (or one is listed twice)")
    h = np.zeros(N_BINS, dtype=np.int64)
    h[b] = c
    return h
