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

__all__ = ["HistogramError", "encode_hist", "encode_hists", "hist_list_arrays", "decode_hist"]


class HistogramError(ValueError):
    """A stored histogram cannot be read over this version's bin edges; the message says why."""


def encode_hist(hist) -> tuple[list[int], list[int]]:
    """(bins, counts) of the non-empty bins of a dense histogram."""
    h = np.asarray(hist)
    nz = np.flatnonzero(h)
    return nz.astype(np.int32).tolist(), h[nz].astype(np.int64).tolist()


def encode_hists(hists) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``encode_hist`` of many dense histograms at once: (offsets, bins, counts), histogram i's bins being
    ``bins[offsets[i]:offsets[i + 1]]`` (and its counts likewise); one pass over them all where they are of one
    length, one per histogram otherwise."""
    arrays = [np.asarray(h) for h in hists]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    if not arrays:
        return offsets, np.zeros(0, np.int32), np.zeros(0, np.int64)
    if all(a.ndim == 1 for a in arrays) and len({a.shape for a in arrays}) == 1:
        dense = np.stack(arrays)
        rows, bins = np.nonzero(dense)
        np.cumsum(np.bincount(rows, minlength=len(arrays)), out=offsets[1:])
        return offsets, bins.astype(np.int32), dense[rows, bins].astype(np.int64)
    parts = [encode_hist(a) for a in arrays]
    np.cumsum([len(b) for b, _ in parts], out=offsets[1:])
    return (offsets, np.array([x for b, _ in parts for x in b], dtype=np.int32),
            np.array([x for _, c in parts for x in c], dtype=np.int64))


def hist_list_arrays(hists) -> tuple:
    """(bins, counts) of ``hists`` (dense histograms, or None where a record has none: a null) as Arrow list
    arrays of int32 and int64, the columns the store's histograms table and a shard hold."""
    import pyarrow as pa  # the writers' dependency, not the codec's readers'

    present = [h is not None for h in hists]
    offsets, bins, counts = encode_hists([h for h in hists if h is not None])
    if not all(present):  # a null's list is empty: its offset repeats the one before
        full = np.zeros(len(hists) + 1, dtype=np.int32)
        full[1:][np.array(present)] = np.diff(offsets)
        offsets = np.cumsum(full, dtype=np.int32)
    mask = None if all(present) else pa.array([not p for p in present])
    at = pa.array(offsets)
    return (pa.ListArray.from_arrays(at, pa.array(bins), mask=mask),
            pa.ListArray.from_arrays(at, pa.array(counts), mask=mask))


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
