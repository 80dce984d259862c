"""What went wrong in a session: first non-finite producer, norm artefacts,
comparisons, as a stable JSON document and as a human-readable table.

First non-finite producer of a run, intended ``-inf`` and inherited values: ``precision_lab.origin``
(``analyse`` over the run's facts, which ``run_facts`` reads from the store).

Norm artefacts: a non-finite Norm (or Mean) with finite Max/Min is *not* non-finite: the dump computed the
norm in the tensor's own dtype and the sum of squares overflowed; such records are listed apart.

The JSON document (``build_report``) has the keys ``session``, ``runs``,
``first_nonfinite`` (per run, ``origin.Origin.as_dict()`` or null), ``intended_nonfinite`` (per run,
the ops that wrote a mask's ``-inf``), ``norm_artefacts``, ``tensors``, ``comparisons``,
``worst_comparisons`` (the ``WORST_KEPT`` worst, as Top offenders ranks them, non-finite ones included), ``diagnoses``, ``warnings``, ``alerts`` (a long run's alerts: run, op, step, rule, message, value,
threshold, steps_firing; see ``precision_lab.alerts``), ``timeline`` (per run with a timeline: the first
non-finite step, the steps with full records, and one row per step: loss, loss_scale, nonfinite_values,
grad_norm) and ``notes``.  Non-finite numbers are written
as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so the document is
strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional, Union

from ..display import cosine_brief, num_text
from ..enums import OriginKind
from ..formats import format_for_dtype
from ..origin import (ORDER_TEXT, model_outputs, Intended, Origin, RunFacts, analyse,
                      order_text)
from ..ops import COLLECTIVE_OPS
from ..records import GRAD_ROLES, INPUT_ROLES, STATE_ROLES
from ..store import queries as q
from ..store import ranking
from ..jsoncodec import dumps, fields_tree
from . import timeline as _timeline

__all__ = ["first_nonfinite", "intended_nonfinite", "nonfinite_origin", "run_facts", "norm_artefacts", "build_report",
           "order_notes", "OrderNotes", "NormArtefact", "FiniteRank", "RankOrigin", "RankState",
           "render_text", "to_json", "PATH_LENGTH", "ORDER_TEXT", "order_text"]

PATH_LENGTH = 5  # ops shown before the producer


@dataclass(frozen=True, slots=True)
class OrderNotes:
    """The order each run's dump gave, in words, with which parts are certain, by run id (runs ingest did not say
    for are left out)."""

    by_run: dict[str, str]

    def get(self, run_id: Optional[str], default: Optional[str] = None) -> Optional[str]:
        return self.by_run.get(run_id, default)


@dataclass(frozen=True, slots=True)
class FiniteRank:
    """A rank of a distributed run whose every recorded value is finite."""

    rank: int
    state: str
    text: str

    step = op = role = index = None  # no first non-finite value: read like a ``RankOrigin``'s, these are None


@dataclass(frozen=True, slots=True)
class RankOrigin:
    """A rank of a distributed run that holds an unexpected non-finite value: ``state`` says whether it
    ``produced`` its own or ``received`` it, where it first holds one, and a sentence saying so."""

    rank: int
    state: str
    step: int
    op: str
    role: str
    index: str
    text: str


RankState = Union[FiniteRank, RankOrigin]


@dataclass(frozen=True, slots=True)
class NormArtefact:
    """A record whose Norm or Mean is NaN/Inf while its values are finite: where it is, its statistics, the
    float64 bound ``sqrt(numel) * absmax`` on its true norm, and why it is no non-finite value."""

    run: str
    run_id: str
    rid: int
    step: int
    rank: int
    seq: int
    op: str
    role: str
    index: str
    dtype: Optional[str]
    min: float
    max: float
    mean: Optional[float]
    l2norm: Optional[float]
    norm_bound_f64: float
    reason: str


def run_facts(store, run_id: str) -> RunFacts:
    """What ``origin.analyse`` reads about a run, from the store."""
    run = q.run_row(store, run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r}")
    calls = tuple(q.nonfinite_op_calls(store, run_id, INPUT_ROLES))
    recs = tuple(q.nonfinite_records(store, run_id)) if calls else ()
    parents = q.op_parents(store, run_id).by_op if calls else {}
    return RunFacts(run.name, run_id, run.order, calls, recs, parents,
                    inputs_recorded=bool(calls) and q.records_inputs(store, run_id, INPUT_ROLES),
                    outputs=model_outputs(q.forward_ends(store, run_id), run.order, parents).by_step if calls else {})


def order_notes(store, session: str) -> OrderNotes:
    """run_id -> the order its dump gave, in words, with which parts are certain (what ingest recorded in the
    session's notes: an order list and whether it is call or completion order, file times and their ties, links
    found in the data); runs it did not say for are left out."""
    runs = (store.session(session).notes.get("ingest") or {}).get("runs") or {}
    return OrderNotes({v["run_id"]: v["order_from"] for v in runs.values()
                       if isinstance(v, dict) and v.get("run_id") and v.get("order_from")})


def first_nonfinite(store, run_id: str) -> Optional[Origin]:
    """The origin of ``run_id``'s first unexpected non-finite value (``origin.Origin``), None when it holds
    none (see ``nonfinite_origin``, which also gives the intended ones from the same pass)."""
    return nonfinite_origin(store, run_id)[0]


def intended_nonfinite(store, run_id: str) -> list[Intended]:
    """The op calls of a run that wrote ``-inf`` that is no error by itself (a mask, a constant, ``log(0)``, or
    a module holding one), in execution order."""
    return nonfinite_origin(store, run_id)[1]


def nonfinite_origin(store, run_id: str) -> tuple[Optional[Origin], list[Intended]]:
    """``(origin, intended)`` of a run (``origin.analyse`` over ``run_facts``), with the origin's ``path``:
    the last ``PATH_LENGTH`` op calls before it in the same step and rank, then the op itself."""
    facts = run_facts(store, run_id)
    first, masks = analyse(facts)
    if first is None:
        return None, masks
    first = _producing_rank(facts, first)
    path = q.op_calls_up_to(store, run_id, first.step, first.rank, first.seq, INPUT_ROLES, PATH_LENGTH + 1)
    path = [p for p in path if not (p.seq == first.seq and p.op != first.op)][::-1]
    return first.with_path(path), masks


def _rank_facts(facts: RunFacts, rank: int) -> RunFacts:
    """``facts`` of one rank only."""
    return dataclasses.replace(facts, calls=tuple(c for c in facts.calls if c.rank == rank),
                               records=tuple(x for x in facts.records if x.rank == rank),
                               outputs={k: v for k, v in facts.outputs.items() if k[1] == rank})


def _arrived(o: Origin) -> bool:
    """Whether a rank's first non-finite value is one that reaches a rank from the others: a collective's output,
    or a parameter's gradient or a parameter (what DDP's all-reduce, FSDP's reduce-scatter and all-gather and the
    optimizer step after them write)."""
    return o.op_type in COLLECTIVE_OPS or o.role in GRAD_ROLES + STATE_ROLES or o.origin == OriginKind.PARAMETER


def _producing_rank(facts: RunFacts, first: Origin) -> Origin:
    """With several ranks, the first failure found may be one a rank received: in the same step a collective
    hands every rank the value one rank made (FSDP's reduce-scatter during backward, a tensor-parallel
    all-reduce), and the receiver that comes first by rank number is no producer.  Where ``first`` arrived so,
    the earliest origin another rank computed itself (in the same or an earlier step) is the answer."""
    if not _arrived(first):
        return first
    ranks = sorted({c.rank for c in facts.calls})
    if len(ranks) < 2:
        return first
    made = [o for r in ranks if r != first.rank
            for o in (analyse(_rank_facts(facts, r))[0],) if o is not None and o.step <= first.step
            and not _arrived(o)]
    return min(made, key=lambda o: (o.step, o.rank)) if made else first


def rank_spread(store, run_id: str, first: Optional[Origin]) -> list[RankState]:
    """With several ranks: where each rank other than the origin's first holds an unexpected non-finite value,
    and whether it made that value or received it.  Each rank is analysed on its own records (``origin.analyse``
    over its share of ``run_facts``); a rank whose own first value comes after the origin's step, or at that step
    in a parameter's gradient or a parameter (what a collective writes: DDP's gradient all-reduce, an FSDP
    all-gather, and the optimizer step after them), received it; one that made its own in that step's forward
    or from its own finite inputs before it is a producer too.  ``[]`` for a run of one rank."""
    ranks = q.run_ranks(store, run_id) if first is not None else []
    if len(ranks) < 2:
        return []
    facts = run_facts(store, run_id)
    out = []
    for r in ranks:
        if r == first.rank:
            continue
        mine = _rank_facts(facts, r)
        o = analyse(mine)[0] if mine.calls else None
        if o is None:
            out.append(FiniteRank(r, "finite", f"rank {r}: every value it recorded is finite"))
            continue
        received = o.step > first.step or (o.step == first.step and _arrived(o))
        where = f"{o.op} (step {o.step}, {o.role} {o.index})"
        how = (f"through the {o.op_type} it records" if o.op_type in COLLECTIVE_OPS else
               "through a gradient collective in the same step (FSDP's reduce-scatter, an all-reduce)"
               if o.step == first.step else
               "through a collective (DDP's gradient all-reduce, FSDP's all-gather) and the optimizer step after it")
        text = (f"rank {r}: received it, first non-finite at {where}, after rank {first.rank}'s step {first.step}: "
                f"{how}" if received else f"rank {r}: produced its own, at {where}")
        out.append(RankOrigin(r, "received" if received else "produced", o.step, o.op, o.role, o.index, text))
    return out


def norm_artefacts(store, session_id: str) -> list[NormArtefact]:
    """Records whose Norm or Mean is NaN/Inf while their values are finite.

    That happens when a dump computed the norm (or mean) in the tensor's own
    low-precision dtype: the sum of squares overflowed, not the tensor.
    ``reason`` says so in the format's terms and gives the float64 bound
    ``sqrt(numel) * absmax`` on the true norm.
    """
    rows = q.nonfinite_norms_of_finite_values(store, session_id)
    out = []
    for r in rows:
        fmt = format_for_dtype(r.dtype)
        fname = fmt.name if fmt else (r.dtype or "its dtype")
        absmax = max(abs(r.stats.min), abs(r.stats.max))
        bound = math.sqrt(r.stats.numel or 0) * absmax
        which = [n for n, v in (("Norm", r.stats.l2norm), ("Mean", r.stats.mean))
                 if v is not None and not math.isfinite(v)]
        what = "/".join(which)
        reason = (f"{fname} norm-arithmetic artefact: {what} is {num_text(r.stats.l2norm if 'Norm' in which else r.stats.mean)}"
                  f" while Max {num_text(r.stats.max)} and Min {num_text(r.stats.min)} are finite. The dump computed "
                  f"the {what.lower()} in {fname}")
        if fmt is not None and fmt.kind == "float":
            reason += (f", whose largest finite value is {num_text(fmt.max, grouped=True)}; the float64 norm is at most "
                       f"sqrt(numel) x absmax = {bound:.6g}")
        reason += ". The values did not overflow; this is not a non-finite tensor."
        out.append(NormArtefact(r.run, r.run_id, r.rid, r.step, r.rank, r.seq, r.op, r.role, r.index, r.dtype,
                                r.stats.min, r.stats.max, r.stats.mean, r.stats.l2norm, bound, reason))
    return out


_TENSOR_COLS = ("seq", "op", "op_type", "role", "index", "step", "rank", "direction", "dtype", "shape", "numel",
                "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "mean", "std", "l2norm",
                "nonfinite", "rid", "location")
_RENAME = {"nan_count": "nan", "inf_count": "inf", "zero_count": "zero"}
# max_*_err are element-wise; summary_*_err compare summary statistics (basis "stats") and are kept apart
_CMP_COLS = ("kind", "match", "basis", "step", "rank", "seq", "op", "role", "index", "max_abs_err",
             "mean_abs_err", "max_rel_err", "summary_abs_err", "summary_rel_err", "cosine", "cosine_deficit",
             "sqnr_db", "rounding_units", "nonfinite_introduced", "nonfinite_in_ref", "cand_format", "verdict",
             "reason", "ref_rid", "cand_rid")


WORST_KEPT = 50  # the worst comparisons a report keeps, ranked
_WORST_COLS = ("kind", "seq", "op", "role", "index", "match", "basis", "verdict", "max_abs_err", "max_rel_err",
               "summary_abs_err", "summary_rel_err", "cosine", "cosine_deficit", "sqnr_db", "rounding_units",
               "nonfinite_introduced", "reason")


def build_report(store, session: str) -> dict:
    """The session as one JSON-ready dict (see the module doc for its keys)."""
    info = store.session(session)
    sid = info.session_id
    # reference runs first, then in the order they were added
    runs = q.session_runs(store, sid, references_first=True)
    names = {r.run_id: r.name for r in runs}
    notes = order_notes(store, sid)
    first, intended, spread = {}, {}, {}
    for r in runs:
        f, masks = nonfinite_origin(store, r.run_id)
        first[r.name] = None if f is None else f.as_dict()
        intended[r.name] = [dataclasses.asdict(m) for m in masks]
        spread[r.name] = fields_tree(rank_spread(store, r.run_id, f))
    tensors = []
    for r in runs:
        for t in q.run_tensors(store, r.run_id, _TENSOR_COLS):
            d = {"run": r.name}
            for c, v in zip(_TENSOR_COLS, t):
                d[_RENAME.get(c, c)] = json.loads(v) if c == "shape" and v is not None else v
            tensors.append(d)
    comparisons = []
    paired = ("ref_run_id", "cand_run_id") + _CMP_COLS
    for ref_run_id, cand_run_id, *values in q.session_comparisons(store, sid, paired):
        d = {"ref_run": names.get(ref_run_id), "cand_run": names.get(cand_run_id)}
        d.update(zip(_CMP_COLS, values))
        comparisons.append(d)
    diagnoses = []
    for d in q.session_diagnoses(store, sid):
        diagnoses.append({"run": names.get(d.run_id), "op": d.op, "rule": d.rule, "message": d.message,
                          "fixes": list(d.fixes), "severity": d.severity, "seq": d.seq})
    warnings = [{"run": names.get(w.run_id), "file": w.file, "message": w.message}
                for w in q.session_warning_rows(store, sid)]
    alerts = [dataclasses.asdict(a) for a in _timeline.session_alerts(store, sid)]
    # the worst comparisons as Top offenders ranks them (what a diagnosis names first), non-finite ones too
    worst = ranking.ranked_comparisons(store, sid, ranking.ACCUMULATED_KINDS + ranking.LOCAL_KINDS, n=WORST_KEPT,
                                       include_nonfinite=True)
    worst_comparisons = [{"cand_run": w.run, **{k: getattr(w, k) for k in _WORST_COLS}} for w in worst]
    return {
        "session": info.name,
        "created": info.created,
        "source": info.source,
        "runs": [{"name": r.name, "run_id": r.run_id, "kind": r.kind, "dtype": r.dtype,
                  "parent": names.get(r.parent_run_id) if r.parent_run_id else None, "fix": r.fix,
                  "source": r.source, "order": r.order, "order_text": order_text(r.order),
                  "order_note": notes.get(r.run_id)} for r in runs],
        "first_nonfinite": first,
        "ranks": spread,
        "intended_nonfinite": intended,
        "norm_artefacts": fields_tree(norm_artefacts(store, sid)),
        "tensors": tensors,
        "comparisons": comparisons,
        "worst_comparisons": worst_comparisons,
        "diagnoses": diagnoses,
        "warnings": warnings,
        "alerts": alerts,
        "timeline": {t.run: {"first_nonfinite_step": t.first_nonfinite_step, "full_steps": t.full_steps,
                             "steps": t.steps} for t in _timeline.timeline_report(store, sid)},
        "notes": info.notes,
    }


def to_json(report: dict, *, indent: Optional[int] = 2) -> str:
    """Strict JSON (``allow_nan=False``): non-finite numbers become strings."""
    return dumps(report, indent=indent)


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _listing(title: str, top: int, lines: list[str]) -> list[str]:
    """A titled, indented list of at most ``top`` lines and how many more there are; nothing when empty."""
    if not lines:
        return []
    out = ["", title] + [f"  {ln}" for ln in lines[:top]]
    return out + ([f"  ... and {len(lines) - top} more"] if len(lines) > top else [])


def render_text(report: dict, *, top: int = 15) -> str:
    """A human-readable summary of ``build_report``'s document."""
    out = [f"Session {report['session']}  ({report.get('source') or ''})", ""]
    out += _table([[r["name"], r["kind"], r["dtype"] or "-", r["parent"] or "-", r["fix"] or "-",
                    r.get("order_text") or order_text(r.get("order"))] for r in report["runs"]],
                  ["run", "kind", "dtype", "parent", "fix", "order"])
    said = [f"  {r['name']}: {r['order_note']}" for r in report["runs"] if r.get("order_note")]
    out += (["", "Order used:"] + said) if said else []
    out += ["", "First non-finite producer:"]
    intended = report.get("intended_nonfinite") or {}
    for run, f in report["first_nonfinite"].items():
        masks = intended.get(run) or []
        if f is None:
            out.append(f"  {run}: none (every recorded value is finite)" if not masks else
                       f"  {run}: none (its non-finite values never reach the model's output, a gradient or a "
                       f"parameter: written on purpose by {len(masks)} op(s) (a mask, log(0), a fill), e.g. "
                       f"{masks[0]['op']})")
            continue
        out.append(f"  {run}: {f['op']}  (step {f['step']}, rank {f['rank']}, seq {f['seq']}, {f['role']} {f['index']})")
        out.append(f"    {f['reason']}")
        if f.get("certainty_text"):
            out.append(f"    {f['certainty_text']}")
        if f.get("location"):
            out.append(f"    called from {f['location']}")
        chain = " -> ".join(p["op"] for p in f["path"])
        out.append(f"    path ({order_text(f.get('order'))}): {chain}")
        for r in (report.get("ranks") or {}).get(run) or []:
            out.append(f"    {r['text']}")
    arts = report.get("norm_artefacts") or []
    out += _listing(f"Norm artefacts ({len(arts)}): not non-finite values", top,
                    [f"{a['run']}: {a['op']} {a['role']} {a['index']}: {a['reason']}" for a in arts])
    comps = report["comparisons"]
    if comps:
        counts: dict[tuple, dict[str, int]] = {}
        for c in comps:
            key = (c["cand_run"], c["ref_run"], c.get("kind") == "local")
            v = c["verdict"] or c["match"]
            counts.setdefault(key, {})[v] = counts.setdefault(key, {}).get(v, 0) + 1
        out += ["", "Comparisons:"]
        for (cand, ref, local), d in counts.items():
            summary = ", ".join(f"{k} {n}" for k, n in sorted(d.items()))
            # a local comparison sets each op of a run against its own fp32 re-run: not a second run
            out.append(f"  {cand}: local error (each op against its fp32 re-run): {summary}" if local
                       else f"  {cand} vs {ref}: {summary}")
        # in the order ``build_report`` kept (Top offenders' ranking)
        worst = (report.get("worst_comparisons") or [])[:top]
        # a comparison on summary statistics has no element-wise error: its own columns, where there is one
        by_summary = any(c.get("basis") == "stats" for c in worst)
        rows = [[c["cand_run"], c["op"], f"{c['role']}.{c['index']}", c["match"] or c["kind"], c["basis"] or "-",
                 num_text(c["max_abs_err"]), num_text(c["max_rel_err"])]
                + ([num_text(c.get("summary_abs_err")), num_text(c.get("summary_rel_err"))] if by_summary else [])
                + [cosine_brief(c["cosine"], c["cosine_deficit"]),
                   num_text(c["sqnr_db"]), "-" if c["nonfinite_introduced"] is None else str(c["nonfinite_introduced"]),
                   c["verdict"]] for c in worst]
        if rows:
            out += ["", f"Worst {len(rows)} comparisons:"]
            out += ["  " + ln for ln in _table(rows, ["run", "op", "tensor", "match", "basis", "max_abs", "max_rel"]
                                               + (["summary_abs", "summary_rel"] if by_summary else [])
                                               + ["cosine", "sqnr_db", "nf_new", "verdict"])]
    if report["diagnoses"]:
        out += ["", "Diagnoses:"]
        for d in report["diagnoses"]:
            fixes = f"  fixes: {', '.join(d['fixes'])}" if d["fixes"] else ""
            out.append(f"  [{d['severity']}] {d['run']}: {d['op']}: {d['message']}{fixes}")
    alerts = report.get("alerts") or []
    out += _listing(f"Alerts ({len(alerts)}):", top,
                    [f"[{a['rule']}] {a['run']} step {a['step']}: {a['message']}" for a in alerts])
    for run, t in (report.get("timeline") or {}).items():
        first = t.get("first_nonfinite_step")
        out += ["", f"Timeline of {run}: {len(t['steps'])} steps, full records at {len(t['full_steps'])}; "
                    + (f"first non-finite value at step {first}" if first is not None else "every step finite")]
    out += _listing(f"Warnings ({len(report['warnings'])}):", top,
                    [f"{w['file']}: {w['message']}" for w in report["warnings"]])
    return "\n".join(out) + "\n"
