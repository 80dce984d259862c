"""The magnitude histogram's bin edges: every power of two in range and every registered format's thresholds."""

from __future__ import annotations

import hashlib
import math

import numpy as np

from ..formats import FORMATS


# ---------------------------------------------------------------------------
# histogram edges
# ---------------------------------------------------------------------------

def _build_edges() -> np.ndarray:
    vals = {0.0, math.inf}
    vals.update(math.ldexp(1.0, k) for k in range(-150, 129))
    for fmt in FORMATS.values():
        vals.update(fmt.thresholds())
    return np.array(sorted(vals), dtype=np.float64)


HIST_EDGES: np.ndarray = _build_edges()
HIST_EDGES.setflags(write=False)
HIST_EDGES_ID: str = hashlib.sha256(HIST_EDGES.tobytes()).hexdigest()[:12]
N_BINS: int = len(HIST_EDGES) - 1


def _edge_index(value: float) -> int:
    """Index of ``value`` in HIST_EDGES; every format threshold is an edge."""
    i = int(np.searchsorted(HIST_EDGES, value))
    if i >= len(HIST_EDGES) or HIST_EDGES[i] != value:  # pragma: no cover - guarded by tests
        raise AssertionError(f"{value!r} is not a histogram edge")
    return i


def histogram_counts(absvals) -> np.ndarray:
    """Counts of the nonzero finite magnitudes of ``absvals`` over HIST_EDGES.

    A plain float64 ``np.searchsorted`` (exact; slow but simple).  Signs are
    ignored, zeros and non-finite values are not counted.
    """
    a = np.abs(np.asarray(absvals, dtype=np.float64).ravel())
    a = a[np.isfinite(a) & (a > 0)]
    idx = np.searchsorted(HIST_EDGES, a, side="right") - 1
    return np.bincount(idx, minlength=N_BINS).astype(np.int64)
