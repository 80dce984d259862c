"""Tensor -> TensorStats: exact counts, float64 moments and a magnitude histogram.

What is computed (``tensor_stats``):

* counts of NaN, +/-Inf and zeros (``-0.0`` counts as zero);
* ``min``, ``max``, ``absmax``, ``min_abs_nonzero`` over the *finite* values;
* ``mean``, population ``std`` (ddof=0) and ``l2norm`` over the finite values,
  accumulated in float64 whatever the input dtype (an fp16 tensor whose norm
  exceeds fp16's largest finite value reports its true norm);
* a histogram of ``|x|`` for the nonzero finite values over the fixed edges
  ``HIST_EDGES``.

The edges contain every power of two from 2^-150 to 2^128 and every
registered format's rounding thresholds (``Format.thresholds()``), so for
*any* registered format the number of values that overflow, underflow to
zero, become subnormal or stay normal is an exact sum over bins
(``TensorStats.representability``), also for records read back from the
store, without the tensor.

Rounding model for ``representability``: round-to-nearest-even of the exact
value (single rounding).  For float32 and narrower inputs this is exactly what
``torch`` and ``ml_dtypes`` casts do (checked exhaustively in the tests).
float64 inputs are classified by their exact value; note that torch and
ml_dtypes convert float64 to fp8/fp16 *through float32*, so a float64 value
within half a float32 ulp of a rounding tie can be cast differently by them.

Performance: on CPU, float32 (and anything converted exactly to float32 per
chunk: fp16, bf16, fp8, fp6, fp4, e8m0, 8/16-bit ints, bool) goes through a
one-pass numba kernel (a large tensor in parts, on several threads) that reads each element once;
everything else, every CUDA tensor and every CPU run without numba uses a
pure-torch path in float64 (``backend="torch"``; numpy arrays a float64 numpy
one, ``backend="numpy"``, that never imports torch) that gives the same counts,
extrema and histogram and moments equal to rounding.  Inputs that need a
conversion are processed in chunks of ``chunk_elems`` elements, so a memory-mapped
file larger than RAM works in bounded memory; a dense float32/bf16/fp16 input is
read where it lies.  numba is imported and the kernel loaded from numba's
cache on first use; while the cache is empty (the first command after an
install) the float64 paths run and the kernel compiles in a background process
(``numba_loader``); ``PRECISION_LAB_NO_NUMBA=1`` forces the float64 paths
everywhere.
"""

from __future__ import annotations

from .accumulate import merge_stats
from .codec import HistogramError, decode_hist, encode_hist, encode_hists, hist_list_arrays
from .edges import HIST_EDGES, HIST_EDGES_ID, N_BINS, histogram_counts
from .float64 import DevicePartial, device_partials, finish_partials
from .kernels import numba_available
from .records import (Representability, SummaryHeadroom, TensorStats, canonical_dtype, format_counts,
                      format_counts_above, format_edges, from_json_float, json_float)
from .tensor import summary_stats, tensor_stats

__all__ = [
    "HIST_EDGES",
    "HIST_EDGES_ID",
    "N_BINS",
    "Representability",
    "format_counts",
    "format_counts_above",
    "format_edges",
    "SummaryHeadroom",
    "TensorStats",
    "tensor_stats",
    "summary_stats",
    "histogram_counts",
    "merge_stats",
    "numba_available",
    "canonical_dtype",
    "json_float",
    "from_json_float",
    "DevicePartial",
    "device_partials",
    "finish_partials",
    "HistogramError",
    "encode_hist",
    "encode_hists",
    "hist_list_arrays",
    "decode_hist",
]
