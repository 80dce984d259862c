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

import math
from typing import Optional, Sequence

import numpy as np

from ..records import TensorRecord
from .xcalls import (_ANCHOR_REL, _SAME_DATA_REL, Node, OpCall, OpPair, Pairing, _confidence, _kind, _node_error,
                     _shares_an_input, _sketch_distance, _squeezed, nodes_of, op_calls)
from .xfused import _fused_concats, _fused_regions, _second_values

__all__ = ["pair_runs"]

# a data anchor: sketches at most this far apart (relative to the values' RMS), the runner-up this many times
# further, and element-wise relative error at most _ANCHOR_REL
_ANCHOR_SKETCH = 0.05
_ANCHOR_MARGIN = 4.0


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


def _anchored(A: list[Node], B: list[Node]) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, str]]]:
    """(the anchors in the order of both runs, every anchored pair of node indices with how it was found): name
    anchors and data anchors, and those confirmed by their values even out of order."""
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
    return anchors, [(i, j, "name" if (i, j) in names else "anchor") for i, j, _ in anchors + extra]


def _data_flow(A: list[Node], B: list[Node], anchors: list[tuple[int, int, float]],
               matched: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The nodes paired by the data-flow alignment between consecutive anchors, among those not yet paired."""
    used_i = {i for i, _, _ in matched}
    used_j = {j for _, j, _ in matched}
    out = []
    bounds = [(-1, -1)] + [(i, j) for i, j, _ in anchors] + [(len(A), len(B))]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        ga = [a for a in A[i0 + 1:i1] if a.idx not in used_i]
        gb = [b for b in B[j0 + 1:j1] if b.idx not in used_j]
        if not ga or not gb:
            continue
        S, _ = _score_matrix(ga, gb)
        for i, j in _align(S):
            out.append((ga[i].idx, gb[j].idx, "data-flow"))
    return out


def _pair_group(A: list[Node], B: list[Node]) -> tuple[list[OpPair], list[Node], list[Node]]:
    anchors, matched = _anchored(A, B)
    matched = sorted(matched + _data_flow(A, B, anchors, matched))
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
    out = [p for _, p in sorted(pairs.items())]
    fused, used_a, used_b = _fused_concats(free_a, free_b, by_b)
    free_a = [a for a in free_a if a.idx not in used_a]
    free_b = [b for b in free_b if b.idx not in used_b]
    # one value of one run held twice by the other (a compiled region's output beside the eager re-run of its
    # last op), or a module boundary whose output the other run computed inside another call (a block that
    # returns its last op's output where the reference adds a residual): the lone node is paired by name with
    # the call of the other run's node that bears its name
    out, free_a, free_b = _second_values(out + fused, A, B, free_a, free_b)
    return _fused_regions(out, A, B, free_a, free_b)


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
