"""The rows a diagnosis rule reads about recorded runs, typed (``rules.RunFacts`` answers them).

The store's queries answer them (``store.queries``, built from each query's columns by ``store.rows.rows_as``:
a field is named as the column that fills it); a tensor record is a ``records.StoredRecord`` and a run a
``records.RunInfo``.  A field is None where the store holds NULL: the query gave no value (no comparison, a
summary-only record).

A fact beyond the built-in ones (``rulebook.RunFacts``) is a function ``fn(store, *args)`` registered with
``register_fact(name)`` (or through the ``precision_lab.facts`` entry point group): a rule that declares
``needs=(name,)`` asks it as ``ctx.facts.<name>(*args)``, answered from the store being diagnosed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..records import StoredRecord
from ..registry import Registry

__all__ = ["FACTS", "register_fact", "OpSeen", "LocalError", "FinalOutput", "ErrorGrowth", "PairedValues",
           "StateAfter", "QuantiseCall", "ZeroGradient"]


FACTS = Registry("run fact", group="precision_lab.facts")


def register_fact(name: str, *, replace: bool = False):
    """Register the decorated ``fn(store, *args)`` as the fact ``name`` (see the module's docstring); returns it."""

    def deco(fn):
        FACTS.register(name, fn, replace=replace)
        return fn

    return deco


@dataclass(frozen=True)
class ZeroGradient:
    """A parameter gradient that is 0 in every element, beside the gradient that arrived at its backward op."""
    op: str
    step: int
    rank: int
    seq: int
    index: str
    dtype: str
    numel: int
    arriving_absmax: Optional[float]
    arriving_smallest: Optional[float]


@dataclass(frozen=True)
class OpSeen:
    """An op and where it first appears in execution order."""
    op: str
    seq: int


@dataclass(frozen=True)
class LocalError:
    """An output whose local error (against fp32 recomputed from its own inputs) is judged an error."""
    op: str
    seq: int
    rounding_units: float
    """The error in unit roundoffs of ``cand_format``."""
    sqnr_db: Optional[float]
    cand_format: Optional[str]
    """The format the run computed the op in (a ``FORMATS`` name)."""


@dataclass(frozen=True)
class FinalOutput:
    """The run's last output compared with the reference: the model's output."""
    op: str
    seq: int
    sqnr_db: Optional[float]
    """None when that output holds NaN/inf the reference does not."""
    verdict: Optional[str]
    nonfinite_introduced: Optional[int]


@dataclass(frozen=True)
class ErrorGrowth:
    """One op call's accumulated error against the reference, its output's beside its inputs'."""
    op: str
    op_type: Optional[str]
    step: int
    rank: int
    seq: int
    out_units: float
    """Its output's error in unit roundoffs of ``cand_format``."""
    in_units: float
    """Its inputs' largest error in unit roundoffs of ``cand_format``."""
    out_abs_err: Optional[float]
    """Its output's largest absolute error."""
    out_absmax: Optional[float]
    """Its output's largest magnitude."""
    in_absmax: Optional[float]
    """The smallest largest-magnitude among its inputs."""
    cand_format: Optional[str]


@dataclass(frozen=True)
class PairedValues:
    """A record compared element-wise with the reference, beside the reference record's values."""
    op: str
    op_type: Optional[str]
    step: int
    rank: int
    seq: int
    role: str
    index: str
    dtype: Optional[str]
    numel: Optional[int]
    min: Optional[float]
    max: Optional[float]
    absmax: Optional[float]
    zero_count: Optional[int]
    ref_min: Optional[float]
    ref_max: Optional[float]
    ref_absmax: Optional[float]
    ref_zero_count: Optional[int]
    ref_min_abs_nonzero: Optional[float]


@dataclass(frozen=True)
class StateAfter:
    """The first non-finite parameter or buffer record after a step."""
    op: str
    index: str
    step: int
    nan_count: Optional[int]
    inf_count: Optional[int]
    count: int
    """How many non-finite parameter and buffer records that step holds."""


@dataclass(frozen=True)
class QuantiseCall:
    """One call of a quantise op with its first input and output records."""
    op: str
    step: int
    rank: int
    seq: int
    input: StoredRecord
    """Its first input, with its magnitude histogram where stored."""
    output: StoredRecord
    amax: Optional[float]
    """The max of the ``<path>.amax`` output its scale was built from, where recorded."""
