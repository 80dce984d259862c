"""What went wrong in a session: first non-finite producer, norm artefacts,
comparisons, as a stable JSON document and as a human-readable table.

First non-finite producer of a run: the first op call, in execution order
(``step``, then ``seq``, then ``rank``), whose input records (roles
``input``, ``kwarg``, ``param``, ``grad_output``) are all finite and one of
whose output records (``output``, ``grad_input``, ``param_grad``, or a bare
``tensor``) is not.  An op call is the group of records sharing ``(step,
rank, op)``.  A record is non-finite when its NaN/Inf counts are positive or
its min/max are themselves NaN/Inf; for statistics-only dumps the min/max
are all there is.  A non-finite Norm (or Mean) with finite Max/Min is *not*
non-finite: the dump computed the norm in the tensor's own dtype and the
sum of squares overflowed; such records are listed as norm artefacts.

Containers pass values on.  An op whose name is a dotted prefix of another
candidate's (``model.layers.0`` of ``model.layers.0.mlp.down_proj``) is a
module holding it, not the producer: the innermost candidate is named.
When the run's order is unknown (``runs.order = 'name'``: a dump numbered by
name), the alphabet says nothing about which op ran first: the producer is
an innermost candidate, the reason says "order unknown: by name" and lists
the other innermost candidates (``others``).

The JSON document (``build_report``) has the keys ``session``, ``runs``,
``first_nonfinite``, ``norm_artefacts``, ``tensors``, ``comparisons``,
``diagnoses``, ``warnings`` and ``notes``.  Non-finite numbers are written
as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so the document is
strict JSON.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from ..display import num_text
from ..enums import Verdict
from ..formats import format_for_dtype
from ..store import queries as q
from ..jsoncodec import dumps

__all__ = ["first_nonfinite", "norm_artefacts", "build_report", "render_text", "to_json", "INPUT_ROLES",
           "PATH_LENGTH", "ORDER_TEXT", "order_text"]

# roles that feed an op; every other role is something the op produced
INPUT_ROLES = ("input", "kwarg", "param", "grad_output")
PATH_LENGTH = 5  # ops shown before the producer
# runs.order in words
ORDER_TEXT = {"execution": "execution order", "mtime": "order from file modification times",
              "name": "order unknown: by name"}


def order_text(order: Optional[str]) -> str:
    """A run's ``order`` in words, as the reports and the Overview show it."""
    return ORDER_TEXT.get(order or "execution", order or "")



def first_nonfinite(store, run_id: str) -> Optional[dict]:
    """The first op in ``run_id`` whose inputs are finite and whose output is not.

    Returns None when the run holds no non-finite record.  Keys: ``run``
    (name), ``run_id``, ``op``, ``op_type``, ``direction``, ``seq``,
    ``step``, ``rank``, ``rid``, ``role`` and ``index`` (the first non-finite
    output record), ``producer`` (False when no recorded op produced the
    value: it is already in the inputs of the first op that sees it),
    ``reason`` (a sentence) and ``path``: the last ``PATH_LENGTH`` op calls
    before it in the same step and rank, then the op itself, each ``{op,
    op_type, seq, nonfinite_in, nonfinite_out}``.
    """
    run = q.run_row(store, run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r}")
    groups = q.nonfinite_op_calls(store, run_id, INPUT_ROLES)
    if not groups:
        return None
    order = run["order"] or "execution"
    known = order != "name"
    hit, others = _producer(groups, known)
    producer = hit is not None
    if hit is None:
        hit = groups[0]
    rec = q.first_nonfinite_record(store, run_id, hit["step"], hit["rank"], hit["op"], INPUT_ROLES,
                                   outputs_first=producer)
    path = q.op_calls_up_to(store, run_id, hit["step"], hit["rank"], hit["seq"], INPUT_ROLES, PATH_LENGTH + 1)
    path = [p for p in path if not (p["seq"] == hit["seq"] and p["op"] != hit["op"])][::-1]
    if producer and known:
        reason = (f"{hit['op']} is the first op whose inputs are all finite and whose {rec['role']} "
                  f"{rec['index']} is not")
    elif producer:
        reason = (f"{hit['op']}: its inputs are all finite and its {rec['role']} {rec['index']} is not, and no op "
                  f"inside it is like that ({ORDER_TEXT['name']}, so the innermost such op is named")
        reason += (f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
                   f"{', ...' if len(others) > 5 else ''})" if others else ")")
    else:
        reason = (f"{hit['op']} already receives a non-finite {rec['role']} {rec['index']}; no recorded op "
                  "produced it (it comes from before the first recorded op, e.g. the model's inputs)")
        if not known:
            reason += f" ({ORDER_TEXT['name']})"
    return {
        "run": run["name"], "run_id": run_id, "op": hit["op"], "op_type": hit["op_type"],
        "direction": hit["direction"], "seq": int(hit["seq"]), "step": int(hit["step"]),
        "rank": int(hit["rank"]), "rid": int(rec["rid"]), "role": rec["role"], "index": rec["index"],
        "producer": producer, "reason": reason, "path": path, "order": order, "order_known": known,
        "others": others,
    }


def _inside(op: str, container: str) -> bool:
    return op.startswith(container + ".")


def _producer(groups: list[dict], known: bool) -> tuple[Optional[dict], list[str]]:
    """The producer among ``groups`` (in step, seq, rank, op order) and, when the order is
    unknown, the names of the other innermost candidates of the same step and rank.

    A candidate has finite inputs and a non-finite output.  A candidate with
    another candidate inside it (its name a dotted prefix of the other's, same
    step and rank) is a container that passes the value on: the innermost one
    is named.  With the order known, that is the first candidate in order,
    replaced by the first candidate inside it until none is; with the order
    unknown, the innermost candidates of the first step and rank that has any,
    the first by name named and the others listed.
    """
    cands = [g for g in groups if g["nf_out"] and not g["nf_in"]]
    if not cands:
        return None, []
    first = cands[0]
    local = [g for g in cands if (g["step"], g["rank"]) == (first["step"], first["rank"])]
    if known:
        hit = first
        while True:
            inner = next((g for g in local if _inside(g["op"], hit["op"])), None)
            if inner is None:
                return hit, []
            hit = inner
    innermost = sorted((g for g in local if not any(_inside(o["op"], g["op"]) for o in local)),
                       key=lambda g: (g["seq"], g["op"]))
    return innermost[0], [g["op"] for g in innermost[1:]]


def norm_artefacts(store, session_id: str) -> list[dict]:
    """Records whose Norm or Mean is NaN/Inf while their values are finite.

    That happens when a dump computed the norm (or mean) in the tensor's own
    low-precision dtype: the sum of squares overflowed, not the tensor.
    ``reason`` says so in the format's terms and gives the float64 bound
    ``sqrt(numel) * absmax`` on the true norm.
    """
    rows = q.nonfinite_norms_of_finite_values(store, session_id)
    out = []
    for r in rows:
        fmt = format_for_dtype(r["dtype"])
        fname = fmt.name if fmt else (r["dtype"] or "its dtype")
        absmax = max(abs(r["min"]), abs(r["max"]))
        bound = math.sqrt(r["numel"] or 0) * absmax
        which = [n for n, v in (("Norm", r["l2norm"]), ("Mean", r["mean"]))
                 if v is not None and not math.isfinite(v)]
        what = "/".join(which)
        reason = (f"{fname} norm-arithmetic artefact: {what} is {num_text(r['l2norm'] if 'Norm' in which else r['mean'])}"
                  f" while Max {num_text(r['max'])} and Min {num_text(r['min'])} are finite. The dump computed "
                  f"the {what.lower()} in {fname}")
        if fmt is not None and fmt.kind == "float":
            reason += (f", whose largest finite value is {fmt.max:g}; the float64 norm is at most "
                       f"sqrt(numel) x absmax = {bound:.6g}")
        reason += ". The values did not overflow; this is not a non-finite tensor."
        out.append({**{k: r[k] for k in ("run", "run_id", "rid", "step", "rank", "seq", "op", "role", "index",
                                          "dtype", "min", "max", "mean", "l2norm")},
                    "norm_bound_f64": bound, "reason": reason})
    return out


_TENSOR_COLS = ("seq", "op", "op_type", "role", "index", "step", "rank", "direction", "dtype", "shape", "numel",
                "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "mean", "std", "l2norm",
                "nonfinite", "rid")
_RENAME = {"nan_count": "nan", "inf_count": "inf", "zero_count": "zero"}
_CMP_COLS = ("kind", "match", "basis", "step", "rank", "seq", "op", "role", "index", "max_abs_err",
             "mean_abs_err", "max_rel_err", "cosine", "cosine_deficit", "sqnr_db", "rounding_units",
             "nonfinite_introduced", "nonfinite_in_ref", "cand_format", "verdict", "reason", "ref_rid", "cand_rid")


def build_report(store, session: str) -> dict:
    """The session as one JSON-ready dict (see the module doc for its keys)."""
    info = store.session(session)
    sid = info["session_id"]
    # reference runs first, then in the order they were added
    runs = q.session_runs(store, sid, references_first=True)
    names = {r["run_id"]: r["name"] for r in runs}
    first = {}
    for r in runs:
        first[r["name"]] = first_nonfinite(store, r["run_id"])
    tensors = []
    for r in runs:
        for t in q.run_tensors(store, r["run_id"], _TENSOR_COLS):
            d = {"run": r["name"]}
            for c in _TENSOR_COLS:
                d[_RENAME.get(c, c)] = json.loads(t[c]) if c == "shape" and t[c] is not None else t[c]
            tensors.append(d)
    comparisons = []
    for c in q.session_comparisons(store, sid, ("ref_run_id", "cand_run_id") + _CMP_COLS):
        d = {"ref_run": names.get(c.pop("ref_run_id")), "cand_run": names.get(c.pop("cand_run_id"))}
        d.update(c)
        comparisons.append(d)
    diagnoses = []
    for d in q.session_diagnoses(store, sid):
        diagnoses.append({"run": names.get(d["run_id"]), "op": d["op"], "rule": d["rule"], "message": d["message"],
                          "fixes": json.loads(d["fixes"] or "[]"), "severity": d["severity"], "seq": d["seq"]})
    warnings = [{"run": names.get(w["run_id"]), "file": w["file"], "message": w["message"]}
                for w in q.session_warning_rows(store, sid)]
    return {
        "session": info["name"],
        "created": info["created"],
        "source": info["source"],
        "runs": [{"name": r["name"], "run_id": r["run_id"], "kind": r["kind"], "dtype": r["dtype"],
                  "parent": names.get(r["parent_run_id"]) if r["parent_run_id"] else None, "fix": r["fix"],
                  "source": r["source"], "order": r["order"], "order_text": order_text(r["order"])} for r in runs],
        "first_nonfinite": first,
        "norm_artefacts": norm_artefacts(store, sid),
        "tensors": tensors,
        "comparisons": comparisons,
        "diagnoses": diagnoses,
        "warnings": warnings,
        "notes": info["notes"],
    }


def to_json(report: dict, *, indent: Optional[int] = 2) -> str:
    """Strict JSON (``allow_nan=False``): non-finite numbers become strings."""
    return dumps(report, indent=indent)


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _worst_key(c: dict) -> tuple:
    try:
        rank = -Verdict(c.get("verdict")).rank
    except ValueError:  # no verdict: after every judged comparison
        rank = 1
    ru = c.get("rounding_units")
    mr = c.get("max_rel_err")
    score = ru if isinstance(ru, float) and math.isfinite(ru) else (mr if isinstance(mr, float) else 0.0)
    return (rank, -(score or 0.0), c.get("seq") or 0)


def render_text(report: dict, *, top: int = 15) -> str:
    """A human-readable summary of ``build_report``'s document."""
    out = [f"Session {report['session']}  ({report.get('source') or ''})", ""]
    out += _table([[r["name"], r["kind"], r["dtype"] or "-", r["parent"] or "-", r["fix"] or "-",
                    r.get("order_text") or order_text(r.get("order"))] for r in report["runs"]],
                  ["run", "kind", "dtype", "parent", "fix", "order"])
    out += ["", "First non-finite producer:"]
    for run, f in report["first_nonfinite"].items():
        if f is None:
            out.append(f"  {run}: none (every recorded value is finite)")
            continue
        out.append(f"  {run}: {f['op']}  (step {f['step']}, rank {f['rank']}, seq {f['seq']}, {f['role']} {f['index']})")
        out.append(f"    {f['reason']}")
        chain = " -> ".join(p["op"] for p in f["path"])
        out.append(f"    path ({order_text(f.get('order'))}): {chain}")
    arts = report.get("norm_artefacts") or []
    if arts:
        out += ["", f"Norm artefacts ({len(arts)}): not non-finite values"]
        for a in arts[:top]:
            out.append(f"  {a['run']}: {a['op']} {a['role']} {a['index']}: {a['reason']}")
        if len(arts) > top:
            out.append(f"  ... and {len(arts) - top} more")
    comps = report["comparisons"]
    if comps:
        counts: dict[tuple, dict[str, int]] = {}
        for c in comps:
            key = (c["cand_run"], c["ref_run"])
            v = c["verdict"] or c["match"]
            counts.setdefault(key, {})[v] = counts.setdefault(key, {}).get(v, 0) + 1
        out += ["", "Comparisons:"]
        for (cand, ref), d in counts.items():
            summary = ", ".join(f"{k} {n}" for k, n in sorted(d.items()))
            out.append(f"  {cand} vs {ref}: {summary}")
        worst = sorted((c for c in comps if c["verdict"]), key=_worst_key)[:top]
        rows = [[c["cand_run"], c["op"], f"{c['role']}.{c['index']}", c["match"], c["basis"] or "-",
                 num_text(c["max_abs_err"]), num_text(c["max_rel_err"]),
                 num_text(c["cosine"]) if c["cosine"] is None or c["cosine_deficit"] is None
                 else f"1-{num_text(c['cosine_deficit'])}",
                 num_text(c["sqnr_db"]), str(c["nonfinite_introduced"]), c["verdict"]] for c in worst]
        if rows:
            out += ["", f"Worst {len(rows)} comparisons:"]
            out += ["  " + ln for ln in _table(rows, ["run", "op", "tensor", "match", "basis", "max_abs", "max_rel",
                                                       "cosine", "sqnr_db", "nf_new", "verdict"])]
    if report["diagnoses"]:
        out += ["", "Diagnoses:"]
        for d in report["diagnoses"]:
            fixes = f"  fixes: {', '.join(d['fixes'])}" if d["fixes"] else ""
            out.append(f"  [{d['severity']}] {d['run']}: {d['op']}: {d['message']}{fixes}")
    if report["warnings"]:
        out += ["", f"Warnings ({len(report['warnings'])}):"]
        for w in report["warnings"][:top]:
            out.append(f"  {w['file']}: {w['message']}")
        if len(report["warnings"]) > top:
            out.append(f"  ... and {len(report['warnings']) - top} more")
    return "\n".join(out) + "\n"
