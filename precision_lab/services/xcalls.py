"""What two runs' pairing is made of (``xpair``): each run's forward op calls, grouped into value nodes (calls
that hold the very same output), their values compared up to layout and sketched, and the pairs found."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..formats import format_for_dtype
from ..ops import canonical
from ..records import TensorRecord, to_numpy

__all__ = ["OpCall", "Node", "OpPair", "Pairing", "op_calls", "nodes_of", "aligned", "rel_error", "values_of", "HOW"]

HOW = ("name", "anchor", "data-flow", "fused N:1")
_CALL_INPUTS = ("input", "kwarg")
_CALL_OUTPUTS = ("output", "tensor")
# quantile positions of the layout-free sketch
_Q = np.linspace(0.0, 1.0, 17)
# element-wise relative error at most this: values that agree (a data anchor's, a pair's full confidence)
_ANCHOR_REL = 0.05
# in the data-flow alignment, values this close (relative error) count as the same data whatever the op type
_SAME_DATA_REL = 0.25


def values_of(rec: TensorRecord) -> Optional[np.ndarray]:
    """A record's kept tensor as float64 numpy (its own shape), or None."""
    if rec.tensor is None:
        return None
    a = np.asarray(to_numpy(rec.tensor))
    return a.astype(np.float64, copy=False) if a.dtype.kind in "fiub" else None


def _is_float(rec: TensorRecord) -> bool:
    fmt = format_for_dtype(rec.stats.dtype)
    return (fmt is not None and fmt.kind == "float") or "float64" in str(rec.stats.dtype)


@dataclass(frozen=True, eq=False)
class OpCall:
    """One forward op call of a run: its inputs and outputs (records in the order recorded)."""

    pos: int  # position in the run's execution order (per step and rank)
    op: str
    op_type: str
    seq: int
    step: int
    rank: int
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]

    @property
    def out(self) -> TensorRecord:
        """The first non-empty floating-point output: what a call is paired by."""
        return next(r for r in self.outputs if _is_float(r) and (r.stats.numel or 0) > 0)

    @property
    def module(self) -> str:
        """The module path the call ran in (``layers.0.mlp`` for ``layers.0.mlp.down_proj.linear.0``'s parent
        module ``layers.0.mlp.down_proj``; a module call's own path)."""
        parts = self.op.split(".")
        return ".".join(parts[:-2])

    @property
    def is_module_call(self) -> bool:
        parts = self.op.split(".")
        return len(parts) >= 2 and parts[-2] == "forward"


def op_calls(records: Sequence[TensorRecord]) -> tuple[list[OpCall], list[OpCall]]:
    """``(pairable, skipped)`` forward op calls of one run, in execution order: a call is pairable when it has a
    floating-point output."""
    groups: dict[tuple, list[TensorRecord]] = {}
    for r in sorted(records, key=lambda r: (r.step, r.rank, r.seq)):
        groups.setdefault((r.step, r.rank, r.direction, r.seq, r.op), []).append(r)
    pairable, skipped = [], []
    counts: dict[tuple, int] = {}
    for (step, rank, direction, seq, op), recs in groups.items():
        key = (step, rank)
        call = OpCall(pos=counts.get(key, 0), op=op, op_type=recs[0].op_type, seq=seq, step=step, rank=rank,
                      inputs=tuple(r for r in recs if r.role in _CALL_INPUTS),
                      outputs=tuple(r for r in recs if r.role in _CALL_OUTPUTS))
        if direction != "forward":
            skipped.append(call)
            continue
        counts[key] = call.pos + 1
        ok = any(_is_float(r) and (r.stats.numel or 0) > 0 for r in call.outputs)
        (pairable if ok else skipped).append(call)
    return pairable, skipped


# ---- values: layout, error, sketch ---------------------------------------------------------------

def _squeezed(shape) -> tuple:
    return tuple(int(s) for s in shape if int(s) != 1)


def aligned(ref: np.ndarray, cand: np.ndarray) -> Optional[np.ndarray]:
    """``cand`` laid out as ``ref`` (same shape, a permutation of its axes, or the same elements in another
    shape), or None when their sizes differ.  Of several permutations the one closest to ``ref`` is taken."""
    if ref.size != cand.size:
        return None
    if ref.shape == cand.shape:
        return cand
    rs, cs = _squeezed(ref.shape), _squeezed(cand.shape)
    c = cand.reshape(cs)
    if rs == cs or len(cs) > 5 or sorted(rs) != sorted(cs):
        return c.reshape(ref.shape)
    target = ref.reshape(rs)
    best, best_err = None, math.inf
    for perm in itertools.permutations(range(len(cs))):
        if tuple(cs[p] for p in perm) != rs:
            continue
        t = np.transpose(c, perm)
        err = float(np.sum((t - target) ** 2))
        if err < best_err:
            best, best_err = t, err
    return np.ascontiguousarray(best).reshape(ref.shape)


def rel_error(ref: np.ndarray, cand: np.ndarray) -> float:
    """Norm-wise relative error ``|c - r| / |r|`` over positions finite in both (0 when equal, inf when ``r`` is
    zero and ``c`` is not)."""
    ok = np.isfinite(ref) & np.isfinite(cand)
    if not ok.all():
        if (np.isfinite(ref) != np.isfinite(cand)).any():
            return math.inf
        ref, cand = ref[ok], cand[ok]
    d = float(np.linalg.norm(cand - ref))
    n = float(np.linalg.norm(ref))
    if d == 0.0:
        return 0.0
    return d / n if n > 0 else math.inf


def _sketch(rec: TensorRecord, vals: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """A layout-free sketch of a tensor's values, scaled by their RMS: quantiles of the sorted finite values and
    the log of the RMS; from summary statistics when no tensor was kept."""
    if vals is not None:
        v = vals[np.isfinite(vals)].ravel()
        if v.size == 0:
            return None
        rms = float(np.sqrt(np.mean(v * v)))
        q = np.quantile(v, _Q) / (rms if rms > 0 else 1.0)
        return np.concatenate([q, [math.log(rms) if rms > 0 else -700.0]])
    s = rec.stats
    if s.l2norm is None or not s.numel or s.min is None or s.max is None:
        return None
    rms = float(s.l2norm) / math.sqrt(s.numel)
    if not (math.isfinite(rms) and math.isfinite(s.min) and math.isfinite(s.max)):
        return None
    d = rms if rms > 0 else 1.0
    return np.array([s.min / d, (s.mean or 0.0) / d, (s.std or 0.0) / d, s.max / d,
                     math.log(rms) if rms > 0 else -700.0])


# ---- nodes: one value, one or more calls -----------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Node:
    """Consecutive calls of one run that hold the same output value (innermost call first)."""

    idx: int  # position among the run's nodes
    calls: tuple[OpCall, ...]
    values: Optional[np.ndarray]  # the output's values (float64), when kept
    sketch: Optional[np.ndarray]

    @property
    def first(self) -> OpCall:
        return self.calls[0]

    @property
    def last(self) -> OpCall:
        return self.calls[-1]

    @property
    def numel(self) -> int:
        return int(self.first.out.stats.numel or 0)

    @property
    def shape(self) -> tuple:
        return tuple(self.first.out.stats.shape or ())

    def has(self, name: str) -> bool:
        return any(c.op == name for c in self.calls)


def _same_value(a: OpCall, av: Optional[np.ndarray], b: OpCall, bv: Optional[np.ndarray]) -> bool:
    """The very same values in the same element order (a view of another shape, as a module returns its last op's
    output reshaped, is the same value)."""
    if av is not None and bv is not None:
        return av.size == bv.size and np.array_equal(av.ravel(), bv.ravel(), equal_nan=True)
    sa, sb = a.out.stats, b.out.stats
    return (tuple(sa.shape or ()) == tuple(sb.shape or ()) and sa.numel == sb.numel
            and all(getattr(sa, f) == getattr(sb, f) for f in ("min", "max", "mean", "l2norm"))
            and sa.l2norm is not None)


def _value_key(c: OpCall, v: Optional[np.ndarray]) -> Optional[tuple]:
    if v is not None:
        return (v.size, hash(np.ascontiguousarray(v).tobytes()))
    s = c.out.stats
    if s.l2norm is None:
        return None
    return (tuple(s.shape or ()), s.numel, s.min, s.max, s.mean, s.l2norm)


def nodes_of(calls: Sequence[OpCall]) -> list[Node]:
    """The calls of one (step, rank) grouped into value nodes (see the module doc): a call whose output is the
    very value of an earlier node (a module call around its last op, a cast to the dtype it already has) joins
    that node."""
    groups: list[list[OpCall]] = []
    vals: list[Optional[np.ndarray]] = []
    seen: dict[tuple, int] = {}
    for c in calls:
        v = values_of(c.out)
        key = _value_key(c, v)
        k = seen.get(key) if key is not None else None
        if k is not None and _same_value(groups[k][0], vals[k], c, v):
            groups[k].append(c)
            continue
        if key is not None:
            seen[key] = len(groups)
        groups.append([c])
        vals.append(v)
    return [Node(i, tuple(g), v, _sketch(g[0].out, v)) for i, (g, v) in enumerate(zip(groups, vals))]


def _node_error(a: Node, b: Node) -> Optional[float]:
    if a.values is None or b.values is None:
        return None
    c = aligned(a.values, b.values)
    return None if c is None else rel_error(a.values, c)


def _sketch_distance(a: Node, b: Node) -> float:
    if a.sketch is None or b.sketch is None or a.sketch.shape != b.sketch.shape:
        return math.inf
    return float(np.max(np.abs(a.sketch - b.sketch)))


def _shares_an_input(first: OpCall, region: OpCall) -> bool:
    for a in first.inputs:
        av = values_of(a)
        for b in region.inputs:
            bv = values_of(b)
            if av is not None and bv is not None:
                c = aligned(av, bv)
                if c is not None and rel_error(av, c) <= _SAME_DATA_REL:
                    return True
            elif a.stats.numel == b.stats.numel and a.stats.shape == b.stats.shape:
                return True
    return False


def _kind(call: OpCall) -> str:
    return canonical(call.op_type) or call.op_type.lower()


# ---- pairs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpPair:
    """Calls of the reference run and of the candidate run that compute the same value.

    ``ref``/``cand``: the calls (several on one side for a fused region or fused projections, and for a
    module call together with the op inside it); ``how``: one of ``HOW``; ``confidence`` in (0, 1];
    ``value_error``: the element-wise relative error of the outputs when both were kept (None otherwise);
    ``concat``: one side's output is the other side's outputs concatenated on the last axis (either side may hold
    the fused call);
    ``ref_value``/``cand_value``: the compared outputs (float64, the split side's concatenated), when kept.
    """

    ref: tuple[OpCall, ...]
    cand: tuple[OpCall, ...]
    how: str
    confidence: float
    value_error: Optional[float] = None
    concat: bool = False
    ref_value: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    cand_value: Optional[np.ndarray] = field(default=None, compare=False, repr=False)

    @property
    def ref_ops(self) -> tuple[str, ...]:
        return tuple(c.op for c in self.ref)

    @property
    def cand_ops(self) -> tuple[str, ...]:
        return tuple(c.op for c in self.cand)

    @property
    def label(self) -> str:
        """``ref op -> cand op``, the innermost op of each side (``+N`` more calls)."""
        def side(calls):
            more = len(calls) - 1
            return calls[0].op + (f" (+{more})" if more else "")
        return f"{side(self.ref)} -> {side(self.cand)}"


@dataclass(frozen=True)
class Pairing:
    """Every forward call of both runs exactly once: in a pair, unpaired, or skipped (no float output or not a
    forward call)."""

    pairs: tuple[OpPair, ...]
    unpaired_ref: tuple[OpCall, ...]
    unpaired_cand: tuple[OpCall, ...]
    skipped_ref: tuple[OpCall, ...] = ()
    skipped_cand: tuple[OpCall, ...] = ()

    def count(self, how: str) -> int:
        return sum(1 for p in self.pairs if p.how == how)


def _confidence(how: str, err: Optional[float], same_name: bool) -> float:
    if err is None:  # summary statistics only: position and size, not the values, say it
        base = {"name": 0.9, "anchor": 0.8, "data-flow": 0.6, "fused N:1": 0.6}[how]
        return base
    agree = 1.0 if err <= _ANCHOR_REL else max(0.0, 1.0 - err)
    base = {"name": 0.8, "anchor": 0.9, "data-flow": 0.6, "fused N:1": 0.7}[how]
    return round(min(1.0, base + (1.0 - base) * agree if agree else base * (0.6 if not same_name else 1.0)), 3)
