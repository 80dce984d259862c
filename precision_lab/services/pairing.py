"""Pair a candidate run's records with a reference run's, and compare each pair.

Matching, within each (step, rank):

1. **exact**: same name (``op.role.index``) and same shape.
2. **aligned**: the records left over on both sides, per direction, in
   execution order, aligned by their signature ``(op_type, role, index,
   shape)`` with a longest-common-subsequence alignment (``difflib``).  This
   pairs ops whose names differ only by call counters or prefixes (an extra
   cast in the low-precision run shifts every later ``Tensor.add.N``), and it
   works on statistics-only dumps because it looks at shapes, not values.
3. everything else is **unmatched** (``unmatched_ref`` / ``unmatched_cand``)
   and is stored without a comparison: never counted as passing.

Comparison of a pair: element-wise ``metrics.compare`` (kind
``"accumulated"``) when both sides have tensor data, else
``metrics.compare_stats`` on their summary statistics (kind ``"stats"``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from ..records import TensorRecord
from ..formats import format_for_dtype
from ..metrics import compare, compare_stats

__all__ = ["Item", "Match", "match_records", "exact_key", "compare_pair", "compare_runs", "RunComparison",
           "verdict_format"]


@dataclass
class Item:
    """A stored record as pairing needs it: its rid, the record (stats may
    lack the histogram; ``tensor`` is usually None) and whether the dump
    holds its data (so it can be loaded for an element-wise comparison)."""

    rid: int
    record: TensorRecord
    has_data: bool = False

    @property
    def shape(self) -> tuple:
        return tuple(self.record.stats.shape or ())


@dataclass(frozen=True)
class Match:
    ref: Optional[Item]
    cand: Optional[Item]
    match: str  # exact | aligned | unmatched_ref | unmatched_cand


def exact_key(rec: TensorRecord) -> tuple:
    return (rec.step, rec.rank, rec.name)


def _signature(it: Item) -> tuple:
    r = it.record
    return (r.op_type, r.role, r.index, it.shape)


def _order(it: Item) -> tuple:
    return (it.record.seq, it.rid)


def match_records(ref: Sequence[Item], cand: Sequence[Item]) -> list[Match]:
    """Every ref and cand item exactly once, paired where possible (see module doc)."""
    out: list[Match] = []
    ref_by_key: dict[tuple, Item] = {}
    for it in sorted(ref, key=_order):
        ref_by_key.setdefault(exact_key(it.record), it)
    used_ref: set[int] = set()
    rest_cand: list[Item] = []
    for it in sorted(cand, key=_order):
        r = ref_by_key.get(exact_key(it.record))
        if r is not None and r.rid not in used_ref and r.shape == it.shape:
            used_ref.add(r.rid)
            out.append(Match(r, it, "exact"))
        else:
            rest_cand.append(it)
    rest_ref = [it for it in ref if it.rid not in used_ref]

    def groups(items):
        g: dict[tuple, list[Item]] = {}
        for it in items:
            g.setdefault((it.record.step, it.record.rank, it.record.direction), []).append(it)
        for v in g.values():
            v.sort(key=_order)
        return g

    gr, gc = groups(rest_ref), groups(rest_cand)
    for key in sorted(set(gr) | set(gc), key=lambda k: (k[0], k[1], k[2] != "forward")):
        a, b = gr.get(key, []), gc.get(key, [])
        paired_a, paired_b = set(), set()
        if a and b:
            sm = difflib.SequenceMatcher(None, [_signature(x) for x in a], [_signature(x) for x in b],
                                         autojunk=False)
            for blk in sm.get_matching_blocks():
                for k in range(blk.size):
                    out.append(Match(a[blk.a + k], b[blk.b + k], "aligned"))
                    paired_a.add(blk.a + k)
                    paired_b.add(blk.b + k)
        out.extend(Match(x, None, "unmatched_ref") for i, x in enumerate(a) if i not in paired_a)
        out.extend(Match(None, x, "unmatched_cand") for i, x in enumerate(b) if i not in paired_b)
    return out


def verdict_format(tensor_dtype: Optional[str], run_dtype: Optional[str]) -> Optional[str]:
    """The format whose rounding a candidate tensor's error is judged against.

    A tensor kept wider than its run's compute dtype (an fp32 loss in an
    fp16 run) still carries the error the run's fp16 ops made upstream, so
    it is judged against the run's format; otherwise its own dtype decides
    (None: let ``metrics`` infer it from the tensor).
    """

    run_fmt = format_for_dtype(run_dtype) if run_dtype else None
    if run_fmt is None:
        return None
    own = format_for_dtype(tensor_dtype) if tensor_dtype else None
    if own is None or (own.kind == run_fmt.kind == "float" and own.eps < run_fmt.eps):
        return run_fmt.name
    return None


def compare_pair(ref: Item, cand: Item, ref_tensor=None, cand_tensor=None, *,
                 run_dtype: Optional[str] = None) -> tuple[str, Any]:
    """``(kind, Comparison)`` of one pair: element-wise when both tensors are given.

    ``run_dtype``: the candidate run's compute dtype (see ``verdict_format``).
    """

    fmt = verdict_format(cand.record.stats.dtype, run_dtype)
    if ref_tensor is not None and cand_tensor is not None:
        if tuple(ref_tensor.shape) == tuple(cand_tensor.shape):
            return "accumulated", compare(ref_tensor, cand_tensor, cand_format=fmt)
    return "stats", compare_stats(ref.record.stats, cand.record.stats, cand_format=fmt)


@dataclass
class RunComparison:
    """What ``compare_runs`` wrote: counts by match and by verdict."""

    matches: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def count(self, d: dict, k: str) -> None:
        d[k] = d.get(k, 0) + 1


def compare_runs(
    writer,
    ref: Iterable[Item],
    cand: Iterable[Item],
    *,
    ref_run_id: str,
    cand_run_id: str,
    load: Optional[Callable[[str, Item], Any]] = None,
    precomputed: Optional[dict[tuple[int, int], tuple[str, Any]]] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    run_dtype: Optional[str] = None,
) -> RunComparison:
    """Match two runs' records and write one comparison row per pair or leftover.

    ``writer`` is a ``SessionWriter`` (``store.new_session``/``extend_session``)
    in which both runs and their records were added; ``ref``/``cand`` are
    ``Item(rid, record, has_data)`` for every record of each run.
    ``load(run_id, item)`` returns an item's tensor (or None); a record whose
    ``tensor`` is set is used directly.  ``precomputed`` maps ``(ref_rid,
    cand_rid)`` to a ``(kind, Comparison)`` already computed while reading
    (pairs compared as they streamed past).  ``run_dtype`` is the candidate
    run's compute dtype (``verdict_format``).  Unmatched records get a row
    with ``comparison=None`` so they are listed, never counted as passing.
    """
    ref, cand = list(ref), list(cand)
    matches = match_records(ref, cand)
    precomputed = precomputed or {}
    summary = RunComparison()
    to_compare = sum(1 for m in matches if m.ref and m.cand and (m.ref.rid, m.cand.rid) not in precomputed)
    done = 0
    for m in matches:
        summary.count(summary.matches, m.match)
        if m.ref is None or m.cand is None:
            kind = "accumulated" if (m.cand or m.ref).has_data else "stats"
            _add_row(writer, m, kind, None, ref_run_id=ref_run_id, cand_run_id=cand_run_id)
            summary.count(summary.verdicts, "unmatched")
            continue
        got = precomputed.get((m.ref.rid, m.cand.rid))
        if got is None:
            rt = _tensor_of(load, ref_run_id, m.ref) if m.ref.has_data and m.cand.has_data else None
            ct = _tensor_of(load, cand_run_id, m.cand) if rt is not None else None
            got = compare_pair(m.ref, m.cand, rt, ct, run_dtype=run_dtype)
            done += 1
            if progress is not None:
                progress(done, to_compare, f"compare {m.cand.record.op}")
        kind, cmp = got
        _add_row(writer, m, kind, cmp, ref_run_id=ref_run_id, cand_run_id=cand_run_id)
        summary.count(summary.kinds, kind)
        summary.count(summary.verdicts, cmp.verdict)
    return summary


def _tensor_of(load: Optional[Callable[[str, Item], Any]], run_id: str, it: Item):
    """An item's tensor: the record's own, else loaded (when the dump holds its data), else None."""
    if it.record.tensor is not None:
        return it.record.tensor
    if it.has_data and load is not None:
        return load(run_id, it)
    return None


def _add_row(writer, m: Match, kind: str, cmp, *, ref_run_id: str, cand_run_id: str) -> None:
    """The comparison row of one match (``cmp`` None for a record only one run has)."""
    rec = (m.cand or m.ref).record
    writer.add_comparison(
        kind=kind, ref_run_id=ref_run_id, ref_rid=m.ref.rid if m.ref else None, cand_run_id=cand_run_id,
        cand_rid=m.cand.rid if m.cand else None, step=rec.step, rank=rec.rank, seq=rec.seq, op=rec.op,
        role=rec.role, index=rec.index, match=m.match, comparison=cmp,
    )
