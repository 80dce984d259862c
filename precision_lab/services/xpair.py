"""Pair the op calls of two implementations by their data, not only by their names.

Two runs of *different* code (eager vs ``torch.compile``, a ``transformers``
model vs a port with other module names and fused projections, fp32 vs fp8
with extra quantise ops) rarely share names or op counts.  This module pairs
their forward op calls by where they sit in execution order and by what they
hold, in four passes, within each (step, rank):

1. **value nodes**: consecutive calls of one run that hold the very same
   output (a ``Linear`` module call and the ``linear`` op inside it; a block
   and its last residual ``add``; a module returning its last op's output
   reshaped) are one node: a value is paired once.
2. **anchors**: nodes whose op name and output size agree in both runs
   (how ``"name"``), and nodes whose output values match one node of the
   other run and no other (how ``"anchor"``: mutual nearest neighbours of a
   layout-free sketch of the values -- quantiles of the sorted values, which
   survive a small error and a transpose -- confirmed element-wise where
   tensors were kept).  The largest subset in the same order on both sides is
   kept.
3. **data flow**: between consecutive anchors, a monotone alignment (dynamic
   programming) of the remaining nodes by output size, op type and value
   similarity (how ``"data-flow"``).  Nothing is paired whose size differs or
   whose values disagree while neither its op type nor its shape agrees.
4. **fused N:1**: a node left alone on one side whose output is the
   concatenation of consecutive unpaired nodes of the other (fused qkv
   against q, k and v projections), and a node whose paired partner is
   preceded by unpaired calls that start from the same inputs (a compiled
   region recorded only at its boundary against the eager ops inside it).

Each pair says how it was matched and how sure (``confidence`` in (0, 1]);
what cannot be paired is listed in ``unpaired_ref``/``unpaired_cand``, never
forced.  Calls with no floating-point output (index arithmetic, masks) and
backward calls are not paired and are listed in ``skipped``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..formats import format_for_dtype
from ..ops import canonical
from ..records import TensorRecord, to_numpy

__all__ = ["OpCall", "Node", "OpPair", "Pairing", "op_calls", "pair_runs", "aligned", "rel_error", "values_of",
           "HOW"]

HOW = ("name", "anchor", "data-flow", "fused N:1")
_CALL_INPUTS = ("input", "kwarg")
_CALL_OUTPUTS = ("output", "tensor")
# quantile positions of the layout-free sketch
_Q = np.linspace(0.0, 1.0, 17)
# a data anchor: sketches at most this far apart (relative to the values' RMS), the runner-up this many times
# further, and element-wise relative error at most _ANCHOR_REL
_ANCHOR_SKETCH = 0.05
_ANCHOR_MARGIN = 4.0
_ANCHOR_REL = 0.05
# calls that compute in one kernel what other code writes as several ops: a fused region's boundary
_FUSED_KERNELS = frozenset({"scaled_dot_product_attention", "layer_norm", "rms_norm", "group_norm", "batch_norm",
                            "softmax", "log_softmax", "linear", "addmm", "gelu", "silu", "cross_entropy"})
# how many nodes after the last pair a fused projection's parts may lie
_FUSE_WINDOW = 12
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


def _node_error(a: Node, b: Node) -> Optional[float]:
    if a.values is None or b.values is None:
        return None
    c = aligned(a.values, b.values)
    return None if c is None else rel_error(a.values, c)


def _sketch_distance(a: Node, b: Node) -> float:
    if a.sketch is None or b.sketch is None or a.sketch.shape != b.sketch.shape:
        return math.inf
    return float(np.max(np.abs(a.sketch - b.sketch)))


def _lis(pairs: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The heaviest subset of ``(i, j, weight)`` increasing in both i and j (O(n^2), n = anchors)."""
    pairs = sorted(pairs)
    n = len(pairs)
    best = [p[2] for p in pairs]
    prev = [-1] * n
    for k in range(n):
        for m in range(k):
            if pairs[m][0] < pairs[k][0] and pairs[m][1] < pairs[k][1] and best[m] + pairs[k][2] > best[k]:
                best[k], prev[k] = best[m] + pairs[k][2], m
    if not n:
        return []
    k = int(np.argmax(best))
    out = []
    while k >= 0:
        out.append(pairs[k])
        k = prev[k]
    return out[::-1]


def _name_anchors(A: list[Node], B: list[Node]) -> list[tuple[int, int, float]]:
    where_b: dict[str, Node] = {}
    for b in B:
        for c in b.calls:
            where_b.setdefault(c.op, b)
    out = []
    for a in A:
        for c in a.calls:
            b = where_b.get(c.op)
            if b is not None and b.numel == a.numel and any(
                    x.op_type == c.op_type or (x.is_module_call and c.is_module_call) for x in b.calls if x.op == c.op):
                out.append((a.idx, b.idx, 2.0))
                break
    return out


def _data_anchors(A: list[Node], B: list[Node], taken_a: set, taken_b: set) -> list[tuple[int, int, float]]:
    by_a: dict[int, list[Node]] = {}
    by_b: dict[int, list[Node]] = {}
    for a in A:
        if a.idx not in taken_a and a.sketch is not None:
            by_a.setdefault(a.numel, []).append(a)
    for b in B:
        if b.idx not in taken_b and b.sketch is not None:
            by_b.setdefault(b.numel, []).append(b)
    out = []
    for numel, ga in by_a.items():
        gb = by_b.get(numel)
        if not gb:
            continue
        sa = np.stack([a.sketch for a in ga])
        sb = np.stack([b.sketch for b in gb])
        if sa.shape[1] != sb.shape[1]:
            continue
        d = np.max(np.abs(sa[:, None, :] - sb[None, :, :]), axis=2)
        for i in range(len(ga)):
            j = int(np.argmin(d[i]))
            if d[i, j] > _ANCHOR_SKETCH or int(np.argmin(d[:, j])) != i:
                continue
            row = np.sort(d[i])
            col = np.sort(d[:, j])
            second = min(row[1] if len(row) > 1 else math.inf, col[1] if len(col) > 1 else math.inf)
            if second < _ANCHOR_MARGIN * d[i, j] + 1e-3:
                continue
            err = _node_error(ga[i], gb[j])
            if err is not None and err > _ANCHOR_REL:
                continue
            out.append((ga[i].idx, gb[j].idx, 1.0))
    return out


def _kind(call: OpCall) -> str:
    return canonical(call.op_type) or call.op_type.lower()


def _score_matrix(A: list[Node], B: list[Node]) -> tuple[np.ndarray, np.ndarray]:
    """(score, relative error or NaN) of pairing each remaining node of A with each of B; score 0: not
    pairable."""
    S = np.zeros((len(A), len(B)))
    E = np.full((len(A), len(B)), np.nan)
    for i, a in enumerate(A):
        types_a = {_kind(c) for c in a.calls}
        for j, b in enumerate(B):
            if a.numel != b.numel or a.numel == 0:
                continue
            same_type = bool(types_a & {_kind(c) for c in b.calls})
            same_shape = sorted(_squeezed(a.shape)) == sorted(_squeezed(b.shape))  # shape up to layout
            err = _node_error(a, b)
            if err is None:  # summary statistics only: the sketch decides how alike the values are
                dist = _sketch_distance(a, b)
                sim = math.exp(-dist / _ANCHOR_SKETCH) if math.isfinite(dist) else 0.0
            else:
                E[i, j] = err
                sim = max(0.0, 1.0 - err / _SAME_DATA_REL) if math.isfinite(err) else 0.0
            if sim <= 0.0 and not (same_type and same_shape):
                # values that disagree (a bug between them) at one module boundary: a module at the same depth on
                # each side whose inputs agree, and an output of one shape, is the same place in the data flow
                if not _same_boundary(a, b):
                    continue
            S[i, j] = 1.0 + 2.0 * sim + 0.5 * same_type + 0.25 * same_shape
    return S, E


def _outer_module(node: Node) -> Optional[OpCall]:
    return next((c for c in reversed(node.calls) if c.is_module_call), None)


def _same_boundary(a: Node, b: Node) -> bool:
    """Both nodes end a module call at the same depth of the module tree with outputs of one shape (up to layout),
    and the calls share an input (the same values)."""
    ma, mb = _outer_module(a), _outer_module(b)
    if ma is None or mb is None or ma.op.count(".") != mb.op.count("."):
        return False
    if sorted(_squeezed(ma.out.stats.shape or ())) != sorted(_squeezed(mb.out.stats.shape or ())):
        return False
    return _shares_an_input(ma, mb)


def _align(S: np.ndarray) -> list[tuple[int, int]]:
    """The monotone set of cells of positive score with the largest total (row-wise vectorised DP)."""
    n, m = S.shape
    if n == 0 or m == 0:
        return []
    D = np.zeros((n + 1, m + 1))
    for i in range(1, n + 1):
        s = S[i - 1]
        diag = np.where(s > 0, D[i - 1, :-1] + s, -np.inf)
        x = np.maximum(D[i - 1, 1:], diag)
        D[i, 1:] = np.maximum.accumulate(np.maximum(x, 0.0))
    out = []
    i, j = n, m
    while i > 0 and j > 0:
        if D[i, j] == D[i, j - 1]:
            j -= 1
        elif D[i, j] == D[i - 1, j]:
            i -= 1
        else:
            out.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    return out[::-1]


def _confidence(how: str, err: Optional[float], same_name: bool) -> float:
    if err is None:  # summary statistics only: position and size, not the values, say it
        base = {"name": 0.9, "anchor": 0.8, "data-flow": 0.6, "fused N:1": 0.6}[how]
        return base
    agree = 1.0 if err <= _ANCHOR_REL else max(0.0, 1.0 - err)
    base = {"name": 0.8, "anchor": 0.9, "data-flow": 0.6, "fused N:1": 0.7}[how]
    return round(min(1.0, base + (1.0 - base) * agree if agree else base * (0.6 if not same_name else 1.0)), 3)


def _concat_match(cand: Node, run: list[Node]) -> Optional[float]:
    """Relative error of ``cand``'s output against ``run``'s outputs concatenated on the last axis (None: not a
    concatenation of them)."""
    if cand.values is None or any(r.values is None for r in run) or len(run) < 2:
        return None
    if sum(r.numel for r in run) != cand.numel:
        return None
    lasts = [r.values.shape[-1] if r.values.ndim else 1 for r in run]
    lead = {r.numel // d for r, d in zip(run, lasts)}
    if len(lead) != 1:
        return None
    rows = lead.pop()
    ref = np.concatenate([r.values.reshape(rows, d) for r, d in zip(run, lasts)], axis=1)
    return rel_error(ref, cand.values.reshape(rows, -1))


def _same_structure(cand: Node, run: list[Node]) -> bool:
    """Every node of ``run`` computes what ``cand`` computes (the same op type, the same leading shape): fused
    projections whose values moved with their inputs."""
    kinds = {_kind(cand.first)}
    lead = tuple(cand.shape[:-1])
    return all(_kind(a.first) in kinds and tuple(a.shape[:-1]) == lead for a in run)


def _region_start(run: list[Node]) -> OpCall:
    """The first call of a run of nodes that reads floating-point data: a constant made inside a region (a scale
    by ``torch.full``, a table by ``arange``) does not start it."""
    return next((n.first for n in run if any(_is_float(r) for r in n.first.inputs)), run[0].first)


def _starts_from_same_inputs(first: OpCall, region: Sequence[OpCall]) -> bool:
    """Whether one of ``region``'s calls can hold ``first`` and the calls after it: it is a module call or a fused
    kernel, and ``first`` takes one of its inputs (the same values)."""
    for call in region:
        if (call.is_module_call or _kind(call) in _FUSED_KERNELS) and _shares_an_input(first, call):
            return True
    return False


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


def _within(op: str, module: str) -> bool:
    m = ".".join(op.split(".")[:-2])
    return not module or m == module or m.startswith(module + ".")


def _second_values(pairs: list[OpPair], A: list[Node], B: list[Node], free_a: list[Node],
                   free_b: list[Node]) -> tuple[list[OpPair], list[Node], list[Node]]:
    calls_a = {c.op: (a, c) for a in A if a not in free_a for c in a.calls}
    calls_b = {c.op: (b, c) for b in B if b not in free_b for c in b.calls}
    pair_of = {id(c): p for p in pairs for c in p.ref + p.cand}
    keep_a, keep_b = [], []
    for lone, other, keep, ref_side in ((free_a, calls_b, keep_a, True), (free_b, calls_a, keep_b, False)):
        for n in lone:
            hit = next((other[c.op] for c in n.calls if c.op in other and other[c.op][0].numel == n.numel), None)
            if hit is None:
                keep.append(n)
                continue
            m, call = hit
            a, b = (n, m) if ref_side else (m, n)
            err = _node_error(a, b)
            if err is not None and err > _SAME_DATA_REL:
                # a namesake holding other values is the same datum only as a module boundary whose other run
                # computed less inside it (its output is that of an op inside the module); where the op is
                # outside it, the other run's module holds more (a fused region) and is left to the next pass
                p = pair_of.get(id(call))
                theirs = () if p is None else (p.ref_ops if ref_side else p.cand_ops)
                if not (call.is_module_call and theirs and all(_within(op, call.module) for op in theirs)):
                    keep.append(n)
                    continue
            pairs.append(OpPair(n.calls if ref_side else (call,), (call,) if ref_side else n.calls, "name",
                                _confidence("name", err, True), err, ref_value=a.values, cand_value=b.values))
    return pairs, keep_a, keep_b


def _lone_before(nodes: list[Node], i: int, lone: set) -> list[Node]:
    """The unpaired nodes just before node ``i``, in order."""
    run = []
    k = i - 1
    while k in lone:
        run.insert(0, nodes[k])
        k -= 1
    return run


def _concats(whole: list[Node], parts: list[Node], partner: dict[int, int],
             used: set[int]) -> list[tuple[Node, list[Node], float]]:
    """(node, run, error): each lone node of one run (``whole``) whose output concatenates consecutive lone nodes
    of the other (``parts``, their indices added to ``used``), a few nodes after the pair before it (a fused
    projection runs before the ops that separate its parts in the other run); ``partner``: a paired node's index
    in ``whole``'s run -> its partner's."""
    out = []
    for b in whole:
        lo = max([i for j, i in partner.items() if j < b.idx] + [-1])
        cands = [a for a in parts if lo < a.idx <= lo + _FUSE_WINDOW and a.idx not in used]
        hit = None
        for s in range(len(cands)):
            total = 0
            for e in range(s, len(cands)):
                total += cands[e].numel
                if total > b.numel:
                    break
                if total == b.numel and e > s:
                    run = cands[s:e + 1]
                    err = _concat_match(b, run)
                    if err is not None and (err <= _SAME_DATA_REL or _same_structure(b, run)):
                        hit = (run, err)
                    break
            if hit:
                break
        if hit:
            out.append((b, hit[0], hit[1]))
            used.update(a.idx for a in hit[0])
    return out


def _pair_group(A: list[Node], B: list[Node]) -> tuple[list[OpPair], list[Node], list[Node]]:
    named = _name_anchors(A, B)
    names = {(i, j) for i, j, _ in named}
    # a namesake whose values disagree weighs less than a match of the values
    named = [(i, j, w if (e := _node_error(A[i], B[j])) is None or e <= _SAME_DATA_REL else 0.5)
             for i, j, w in named]
    agreeing = _lis([x for x in named if x[2] > 1])
    data = _data_anchors(A, B, {i for i, _, _ in agreeing}, {j for _, j, _ in agreeing})
    anchors = _lis(named + data)
    # anchors confirmed by their values stand even out of order (experts run in another order); the others
    # must keep the order of execution
    strong = [(i, j, w) for i, j, w in named + data if w >= 1 and (e := _node_error(A[i], B[j])) is not None
              and e <= _ANCHOR_REL]
    used_i = {i for i, _, _ in anchors}
    used_j = {j for _, j, _ in anchors}
    extra = []
    for i, j, w in sorted(strong, key=lambda x: -x[2]):
        if i not in used_i and j not in used_j:
            extra.append((i, j, w))
            used_i.add(i)
            used_j.add(j)
    matched: list[tuple[int, int, str]] = [(i, j, "name" if (i, j) in names else "anchor")
                                           for i, j, _ in anchors + extra]
    # data flow between consecutive anchors
    bounds = [(-1, -1)] + [(i, j) for i, j, _ in anchors] + [(len(A), len(B))]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        ga = [a for a in A[i0 + 1:i1] if a.idx not in used_i]
        gb = [b for b in B[j0 + 1:j1] if b.idx not in used_j]
        if not ga or not gb:
            continue
        S, _ = _score_matrix(ga, gb)
        for i, j in _align(S):
            matched.append((ga[i].idx, gb[j].idx, "data-flow"))
    matched.sort()
    pairs: dict[int, OpPair] = {}
    by_b: dict[int, int] = {}
    for i, j, how in matched:
        a, b = A[i], B[j]
        err = _node_error(a, b)
        same_name = any(b.has(c.op) for c in a.calls)
        pairs[i] = OpPair(a.calls, b.calls, how, _confidence(how, err, same_name), err, ref_value=a.values,
                          cand_value=b.values)
        by_b[j] = i
    free_a = [a for a in A if a.idx not in pairs]
    free_b = [b for b in B if b.idx not in by_b]
    # fused N:1: a lone node of either run whose output concatenates consecutive lone nodes of the other (fused
    # qkv against q, k and v projections, whichever run holds the fused one)
    by_a = {i: j for j, i in by_b.items()}
    used_a: set[int] = set()
    used_b: set[int] = set()
    out = [p for _, p in sorted(pairs.items())]
    for whole, parts, partner, used_whole, used_parts, whole_is_ref in (
            (free_b, free_a, by_b, used_b, used_a, False), (free_a, free_b, by_a, used_a, used_b, True)):
        for node, run, err in _concats([n for n in whole if n.idx not in used_whole], parts, partner, used_parts):
            used_whole.add(node.idx)
            rows = run[0].numel // (run[0].values.shape[-1] if run[0].values.ndim else 1)
            cat = np.concatenate([n.values.reshape(rows, -1) for n in run], axis=1)
            run_calls = tuple(c for n in run for c in n.calls)
            own = node.values.reshape(rows, -1)
            ref_calls, cand_calls = (node.calls, run_calls) if whole_is_ref else (run_calls, node.calls)
            ref_v, cand_v = (own, cat) if whole_is_ref else (cat, own)
            out.append(OpPair(ref_calls, cand_calls, "fused N:1", _confidence("fused N:1", err, False), err,
                              concat=True, ref_value=ref_v, cand_value=cand_v))
    done_b = used_b
    free_a = [a for a in free_a if a.idx not in used_a]
    free_b = [b for b in free_b if b.idx not in done_b]
    # one value of one run held twice by the other (a compiled region's output beside the eager re-run of its
    # last op), or a module boundary whose output the other run computed inside another call (a block that
    # returns its last op's output where the reference adds a residual): the lone node is paired by name with
    # the call of the other run's node that bears its name
    out, free_a, free_b = _second_values(out, A, B, free_a, free_b)
    # fused region: lone calls of one side just before a pair, starting from the inputs of the other side's
    # call (a compiled region recorded at its boundary against the eager ops inside it, one attention kernel
    # against the ops of a written-out attention)
    lone_a = {a.idx for a in free_a}
    lone_b = {b.idx for b in free_b}
    pos_a = {id(c): a.idx for a in A for c in a.calls}
    pos_b = {id(c): b.idx for b in B for c in b.calls}
    final = []
    for p in out:
        if p.how == "fused N:1":
            final.append(p)
            continue
        run_a = _lone_before(A, pos_a[id(p.ref[0])], lone_a)
        run_b = _lone_before(B, pos_b[id(p.cand[0])], lone_b)
        if run_a and not run_b and _starts_from_same_inputs(_region_start(run_a), p.cand):
            lone_a.difference_update(a.idx for a in run_a)
            p = OpPair(tuple(c for a in run_a for c in a.calls) + p.ref, p.cand, "fused N:1",
                       min(p.confidence, 0.8), p.value_error, ref_value=p.ref_value, cand_value=p.cand_value)
        elif run_b and not run_a and _starts_from_same_inputs(_region_start(run_b), p.ref):
            lone_b.difference_update(b.idx for b in run_b)
            p = OpPair(p.ref, tuple(c for b in run_b for c in b.calls) + p.cand, "fused N:1",
                       min(p.confidence, 0.8), p.value_error, ref_value=p.ref_value, cand_value=p.cand_value)
        final.append(p)
    free_a = [a for a in free_a if a.idx in lone_a]
    free_b = [b for b in free_b if b.idx in lone_b]
    return final, free_a, free_b


def pair_runs(ref: Sequence[TensorRecord], cand: Sequence[TensorRecord]) -> Pairing:
    """Pair two runs' records by their data (see the module doc).  Records with ``tensor`` set are compared by
    value; the others by their summary statistics."""
    ref_calls, ref_skip = op_calls(ref)
    cand_calls, cand_skip = op_calls(cand)
    ga: dict[tuple, list[OpCall]] = {}
    gb: dict[tuple, list[OpCall]] = {}
    for c in ref_calls:
        ga.setdefault((c.step, c.rank), []).append(c)
    for c in cand_calls:
        gb.setdefault((c.step, c.rank), []).append(c)
    pairs: list[OpPair] = []
    un_a: list[OpCall] = []
    un_b: list[OpCall] = []
    for key in sorted(set(ga) | set(gb)):
        A, B = nodes_of(ga.get(key, [])), nodes_of(gb.get(key, []))
        p, fa, fb = _pair_group(A, B)
        pairs.extend(p)
        un_a.extend(c for a in fa for c in a.calls)
        un_b.extend(c for b in fb for c in b.calls)
    pairs.sort(key=lambda p: (p.ref[-1].step, p.ref[-1].rank, p.ref[-1].pos))
    return Pairing(tuple(pairs), tuple(un_a), tuple(un_b), tuple(ref_skip), tuple(cand_skip))
