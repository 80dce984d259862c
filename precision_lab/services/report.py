"""What went wrong in a session: first non-finite producer, norm artefacts,
comparisons, as a stable JSON document and as a human-readable table.

First non-finite producer of a run: the first op call, in execution order
(``step``, then ``seq``, then ``rank``), whose input records (roles
``input``, ``kwarg``, ``param``, ``grad_output``) hold no unexpected
non-finite value and one of whose output records (``output``,
``grad_input``, ``param_grad``, or a bare ``tensor``) does.  An op call is
the group of records sharing ``(step, rank, op)``.  A record is non-finite
when its NaN/Inf counts are positive or its min/max are themselves NaN/Inf;
for statistics-only dumps the min/max are all there is.  A non-finite Norm
(or Mean) with finite Max/Min is *not* non-finite: the dump computed the
norm in the tensor's own dtype and the sum of squares overflowed; such
records are listed as norm artefacts.

Unexpected, intended, inherited.  With a reference run, a candidate record
is unexpected only where it holds NaN/inf the reference does not (the
comparison's ``nonfinite_introduced``: element-wise with tensors, beyond the
reference's signed counts with statistics).  Without one, ``-inf`` written
by a masking op (``masked_fill``, ``where``, ``full``, ``fill``, ``triu``,
``tril``) or by ``log`` (exactly log(0)) over finite inputs is intended, and so is ``-inf`` passed on by an
op that received it; a softmax over masked rows is healthy.  Intended values
are listed apart (``intended``, ``intended_nonfinite``), never blamed.  A
parameter that is already non-finite (an fp32 weight beyond the format's
max, cast) is itself the origin, named with its value.

Containers pass values on.  An op whose name is a dotted prefix of another
candidate's (``model.layers.0`` of ``model.layers.0.mlp.down_proj``) is a
module holding it, not the producer: the innermost candidate is named.
When the run's order is unknown (``runs.order = 'name'``: a dump numbered by
name), the alphabet says nothing about which op ran first: the producer is
an innermost candidate, the reason says "order unknown: by name" and lists
the other innermost candidates (``others``).

The JSON document (``build_report``) has the keys ``session``, ``runs``,
``first_nonfinite``, ``intended_nonfinite`` (per run, the ops that wrote a mask's
``-inf``), ``norm_artefacts``, ``tensors``, ``comparisons``,
``diagnoses``, ``warnings``, ``alerts`` (a long run's alerts: run, op, step, rule, message, value,
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
from typing import Optional

from ..display import num_text
from ..enums import Verdict
from ..formats import format_for_dtype
from ..ops import MASKING_OPS, canonical, module_path
from ..records import INPUT_ROLES
from ..stats import TensorStats
from ..store import queries as q
from ..jsoncodec import dumps
from . import timeline as _timeline

__all__ = ["first_nonfinite", "intended_nonfinite", "nonfinite_origin", "norm_artefacts", "build_report", "render_text", "to_json", "INPUT_ROLES",
           "PATH_LENGTH", "ORDER_TEXT", "order_text"]

# roles that feed an op; every other role is something the op produced
PATH_LENGTH = 5  # ops shown before the producer
# runs.order in words
ORDER_TEXT = {"execution": "execution order", "data": "order recovered from the data (outputs that are later inputs)",
              "mtime": "order from file modification times", "name": "order unknown: by name"}


def order_text(order: Optional[str]) -> str:
    """A run's ``order`` in words, as the reports and the Overview show it."""
    return ORDER_TEXT.get(order or "execution", order or "")



def first_nonfinite(store, run_id: str) -> Optional[dict]:
    """The op (or parameter) that introduced ``run_id``'s first unexpected non-finite value (see
    ``nonfinite_origin``, which also gives the intended ones from the same pass)."""
    return nonfinite_origin(store, run_id)[0]


def intended_nonfinite(store, run_id: str) -> list[dict]:
    """The op calls of a run that wrote ``-inf`` that is no error by itself (a masking op over finite inputs,
    ``log(0)``, or a module holding one): ``{op, op_type, step, rank, seq, count}``, in execution order."""
    return nonfinite_origin(store, run_id)[1]


def nonfinite_origin(store, run_id: str) -> tuple[Optional[dict], list[dict]]:
    """``(first, intended)`` of a run from one pass over its non-finite records.

    ``intended``: what ``intended_nonfinite`` returns.  ``first``: the op (or
    parameter) that introduced the first unexpected non-finite value; None
    when the run holds none (a run whose only NaN/inf are an attention mask's
    ``-inf`` is clean).  Its keys: ``run`` (name), ``run_id``, ``op``,
    ``op_type``, ``direction``, ``seq``, ``step``, ``rank``, ``rid``,
    ``role`` and ``index`` (the first non-finite record named),
    ``origin`` (``"op"``: the op introduced it; ``"parameter"``: a parameter
    was already non-finite, e.g. after the model's cast, and ``parameter``
    says which and why; ``"input"``: it came from before the first recorded
    op), ``producer`` (``origin == "op"``), ``reason`` (a sentence),
    ``in_reference`` (True when the reference run has the same non-finite
    values, so nothing was introduced by the lower precision), ``first_nan``
    (the op that introduced the first NaN, when another op introduced an
    inf before it), ``intended`` (ops that wrote a mask's ``-inf``) and
    ``path``: the last ``PATH_LENGTH`` op calls before it in the same step
    and rank, then the op itself, each ``{op, op_type, seq, nonfinite_in,
    nonfinite_out}``.
    """
    run = q.run_row(store, run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r}")
    groups = q.nonfinite_op_calls(store, run_id, INPUT_ROLES)
    if not groups:
        return None, []
    recs = q.nonfinite_records(store, run_id)
    parents = q.op_parents(store, run_id)
    compared = any(r["introduced"] is not None for r in recs)
    calls = _classify(groups, recs, use_reference=compared, parents=parents)
    in_reference = False
    first_event = next((c for c in calls if c["nf_in"] or c["nf_out"]), None)
    if compared and (first_event is None or first_event["shared_in"]):
        # nothing was introduced by the lower precision before the reference's own non-finite values arrived:
        # the reference has them too, and the op that made them there is the answer
        calls = _classify(groups, recs, use_reference=False, parents=parents)
        in_reference = True
    masks = [{"op": c["op"], "op_type": c["op_type"], "step": int(c["step"]), "rank": int(c["rank"]),
              "seq": int(c["seq"]), "count": c["intended_count"]}
             for c in calls if c["intended_out"] and not c["nf_out"]]
    intended = [m["op"] for m in masks]
    events = [c for c in calls if c["nf_in"] or c["nf_out"]]
    if not events:
        return None, masks
    order = run["order"] or "execution"
    known = order != "name"
    hit, others, origin = _origin(events, known, parents)
    param = _parameter(hit) if origin == "parameter" else None
    producer = origin == "op"
    rec = hit["first_rec"] if origin == "op" else (param["record"] if param else hit["first_in"])
    path = q.op_calls_up_to(store, run_id, hit["step"], hit["rank"], hit["seq"], INPUT_ROLES, PATH_LENGTH + 1)
    path = [p for p in path if not (p["seq"] == hit["seq"] and p["op"] != hit["op"])][::-1]
    if origin == "parameter":
        reason = param["reason"]
    elif producer and known:
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
    if in_reference:
        reason += "; the reference run holds the same non-finite values"
    if intended:
        reason += (f" ({len(intended)} op(s) wrote -inf that is no error by itself (a mask, or log(0)) and are "
                   "not blamed: "
                   f"{', '.join(intended[:3])}{', ...' if len(intended) > 3 else ''})")
    first_nan = None
    if origin == "op" and known and not hit["nan_out"]:
        nan_hit = next((c for c in events if c["nan_out"] and not c["nan_in"]
                        and (c["step"], c["rank"], c["seq"]) >= (hit["step"], hit["rank"], hit["seq"])), None)
        if nan_hit is not None and nan_hit["op"] != hit["op"]:
            first_nan = {"op": nan_hit["op"], "op_type": nan_hit["op_type"], "seq": int(nan_hit["seq"]),
                         "step": int(nan_hit["step"]), "rank": int(nan_hit["rank"])}
    return {
        "run": run["name"], "run_id": run_id, "op": hit["op"], "op_type": hit["op_type"],
        "direction": hit["direction"], "seq": int(hit["seq"]), "step": int(hit["step"]),
        "rank": int(hit["rank"]), "rid": int(rec["rid"]), "role": rec["role"], "index": rec["index"],
        "location": rec.get("location"), "parent": rec.get("parent"), "origin": origin, "producer": producer, "parameter": param and {k: v for k, v in param.items()
                                                                        if k != "record"},
        "reason": reason, "path": path, "order": order, "order_known": known, "others": others,
        "in_reference": in_reference, "first_nan": first_nan, "intended": intended,
    }, masks


# ---- which non-finite values are unexpected -------------------------------------------------------

def _inside(op: str, container: str, parents: Optional[dict] = None) -> bool:
    """Whether ``op`` ran inside ``container``: by the dump's own nesting (``parents``: op -> enclosing module
    call, msprobe's construct.json) or by name (``container``'s module path is a prefix of ``op``)."""
    if op == container:
        return False
    scope = module_path(container)
    if scope == "" or op.startswith(scope + "."):
        return True
    seen = 0
    p = (parents or {}).get(op)
    while p is not None and seen < 256:  # a parent chain that loops ends here
        if p == container:
            return True
        p, seen = parents.get(p), seen + 1
    return False


def _classify(groups: list[dict], recs: list[dict], *, use_reference: bool,
              parents: Optional[dict] = None) -> list[dict]:
    """Each op call of ``groups`` with what its non-finite records mean.

    A record compared with a reference is unexpected when it holds non-finite
    values the reference does not (``use_reference``); one the reference
    lacks is judged as below when its op received only finite values and
    the run carried none of the reference's own, else taken as passed on.
    Otherwise a record
    whose every non-finite value is ``-inf`` is a mask: an input carrying one
    is expected, and an output carrying one is intended when a masking op
    wrote it (``ops.MASKING_OPS``), when the op received ``-inf`` itself
    (softmax's input, a mask added to scores), or when an op inside the
    module wrote it.  Anything else non-finite is unexpected.
    Adds ``nf_in``/``nf_out`` (unexpected in an input / an output),
    ``nan_in``/``nan_out``, ``intended_out``, ``intended_count``, ``first_rec``
    (the first unexpected output record), ``first_in`` (the first unexpected
    input record) and ``params`` (unexpected parameter records).
    """
    by_call: dict[tuple, list[dict]] = {}
    neg_only: dict[int, Optional[bool]] = {}  # rid -> TensorStats.negative_inf_only
    for r in recs:
        by_call.setdefault((r["step"], r["rank"], r["op"]), []).append(r)
        neg_only[r["rid"]] = TensorStats.from_row(r).negative_inf_only
    out: list[dict] = []
    intended_scopes: list[tuple] = []
    carried: dict[tuple, bool] = {}  # (step, rank) -> a non-finite value the reference shares was seen
    for g in groups:
        rs = by_call.get((g["step"], g["rank"], g["op"]), [])
        ins = [r for r in rs if r["role"] in INPUT_ROLES]
        outs = [r for r in rs if r["role"] not in INPUT_ROLES]
        masking = canonical(g["op_type"]) in MASKING_OPS

        def by_reference(r: dict) -> bool:
            """Whether the reference decides: a compared record, or (no reference tensor to compare) a received
            value, one passed on from non-finite inputs, or one made after the run already carried the
            reference's own non-finite values (through Python, e.g. torch.tensor(x.item())): those are blamed on
            the op that made the first of them."""
            return use_reference and (r.get("introduced") is not None or r["role"] in INPUT_ROLES or bool(ins)
                                      or bool(carried.get((g["step"], g["rank"]))))

        def unexpected(r: dict) -> bool:
            if by_reference(r):
                return r.get("introduced") is not None and int(r["introduced"]) > 0
            return neg_only[r["rid"]] is not True

        bad_in = [r for r in ins if unexpected(r)]
        mask_in = any(r not in bad_in for r in ins)
        # the reference's own NaN/inf arriving here (not a mask): what this op adds to them is not its doing
        shared_in = use_reference and any(r not in bad_in and neg_only[r["rid"]] is not True for r in ins)
        bad_out, good_out = [], []
        for r in outs:
            if by_reference(r):
                (bad_out if unexpected(r) else good_out).append(r)
            elif neg_only[r["rid"]] and (masking or mask_in or any(
                    k[:2] == (g["step"], g["rank"]) and _inside(k[2], g["op"], parents) for k in intended_scopes)):
                good_out.append(r)
            else:
                bad_out.append(r)
        if use_reference and any(r.get("introduced") == 0 for r in rs):
            carried[(g["step"], g["rank"])] = True
        intended_out = (bool(good_out) and not bad_in and not mask_in
                        and all(neg_only[r["rid"]] for r in good_out))
        if intended_out:
            intended_scopes.append((g["step"], g["rank"], g["op"]))
        out.append({**g, "nf_in": bool(bad_in) or shared_in, "nf_out": bool(bad_out), "shared_in": shared_in,
                    "nan_in": any((r["nan_count"] or 0) > 0 for r in bad_in),
                    "nan_out": any((r["nan_count"] or 0) > 0 for r in bad_out),
                    "intended_out": intended_out,
                    "intended_count": sum(int(r["inf_count"] or 0) for r in good_out),
                    "first_rec": bad_out[0] if bad_out else None, "first_in": bad_in[0] if bad_in else None,
                    "params": [r for r in bad_in if r["role"] == "param"]})
    return out


def _origin(events: list[dict], known: bool, parents: Optional[dict] = None) -> tuple[dict, list[str], str]:
    """(the call named, other candidates when the order is unknown, ``"op" | "parameter" | "input"``).

    A candidate has no unexpected non-finite input and an unexpected non-finite
    output.  A candidate with another candidate inside it (same step and rank)
    is a module passing the value on: the innermost one is named.  When the
    first event is an op that *receives* a non-finite value no earlier op
    produced, a parameter of it (or of a module around it) that is already
    non-finite is the origin; else the value came from before the first record.
    With the order unknown, parameters come first, then the innermost
    candidates of the first step and rank, the first by name named and the
    others listed.
    """
    cands = [g for g in events if g["nf_out"] and not g["nf_in"]]
    first = events[0]
    local = [g for g in events if (g["step"], g["rank"]) == (first["step"], first["rank"])]
    with_params = [g for g in local if g["params"]]
    if known:
        if first["nf_out"] and not first["nf_in"]:
            hit = first
            lc = [g for g in cands if (g["step"], g["rank"]) == (first["step"], first["rank"])]
            while True:
                inner = next((g for g in lc if _inside(g["op"], hit["op"], parents)), None)
                if inner is None:
                    return hit, [], "op"
                hit = inner
        holder = next((g for g in with_params if g is first or _inside(first["op"], g["op"], parents)), None)
        if holder is None and first["params"]:
            holder = first
        if holder is not None:
            return holder, [], "parameter"
        return first, [], "input"
    if with_params:
        return with_params[0], [], "parameter"
    if not cands:
        return first, [], "input"
    c0 = cands[0]
    lc = [g for g in cands if (g["step"], g["rank"]) == (c0["step"], c0["rank"])]
    innermost = sorted((g for g in lc if not any(_inside(o["op"], g["op"], parents) for o in lc)),
                       key=lambda g: (g["seq"], g["op"]))
    return innermost[0], [g["op"] for g in innermost[1:]], "op"


def _parameter(call: dict) -> dict:
    """The first non-finite parameter of ``call``, named by its module path, with its value against the format."""
    r = call["params"][0]
    scope = module_path(call["op"])
    name = f"{scope}.{r['index']}" if scope else str(r["index"])
    fmt = format_for_dtype(r["dtype"])
    fname = fmt.name if fmt else (r["dtype"] or "its dtype")
    st = TensorStats.from_row(r)
    what = " and ".join(s for s in (f"{st.nan_count:,} NaN" if st.nan_count else "",
                                    f"{st.inf_count:,} inf" if st.inf_count else "") if s) or "non-finite values"
    ref = r.get("ref_absmax")
    if ref is not None and math.isfinite(ref) and not r.get("ref_nonfinite") and fmt is not None \
            and fmt.kind == "float" and ref >= fmt.overflow_threshold:
        reason = (f"{name} holds {ref:.1e} > {fname} max {num_text(fmt.max, grouped=True)}: {what} after the cast "
                  f"to {fname}, before any op ran")
    elif r.get("ref_nonfinite"):
        reason = f"{name} is already non-finite in the reference run ({what} in {fname}): the stored weights are bad"
    else:
        reason = (f"{name} holds {what} in {fname} before any op used it (stored non-finite, or it overflowed "
                  f"when the model was cast)")
    return {"name": name, "module_op": call["op"], "index": r["index"], "dtype": r["dtype"],
            "ref_absmax": ref, "reason": reason, "record": r}


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
            reason += (f", whose largest finite value is {num_text(fmt.max, grouped=True)}; the float64 norm is at most "
                       f"sqrt(numel) x absmax = {bound:.6g}")
        reason += ". The values did not overflow; this is not a non-finite tensor."
        out.append({**{k: r[k] for k in ("run", "run_id", "rid", "step", "rank", "seq", "op", "role", "index",
                                          "dtype", "min", "max", "mean", "l2norm")},
                    "norm_bound_f64": bound, "reason": reason})
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


def build_report(store, session: str) -> dict:
    """The session as one JSON-ready dict (see the module doc for its keys)."""
    info = store.session(session)
    sid = info["session_id"]
    # reference runs first, then in the order they were added
    runs = q.session_runs(store, sid, references_first=True)
    names = {r["run_id"]: r["name"] for r in runs}
    first, intended = {}, {}
    for r in runs:
        first[r["name"]], intended[r["name"]] = nonfinite_origin(store, r["run_id"])
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
    alerts = [dataclasses.asdict(a) for a in _timeline.session_alerts(store, sid)]
    return {
        "session": info["name"],
        "created": info["created"],
        "source": info["source"],
        "runs": [{"name": r["name"], "run_id": r["run_id"], "kind": r["kind"], "dtype": r["dtype"],
                  "parent": names.get(r["parent_run_id"]) if r["parent_run_id"] else None, "fix": r["fix"],
                  "source": r["source"], "order": r["order"], "order_text": order_text(r["order"])} for r in runs],
        "first_nonfinite": first,
        "intended_nonfinite": intended,
        "norm_artefacts": norm_artefacts(store, sid),
        "tensors": tensors,
        "comparisons": comparisons,
        "diagnoses": diagnoses,
        "warnings": warnings,
        "alerts": alerts,
        "timeline": _timeline.timeline_report(store, sid),
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
    # by error in unit roundoffs, then element-wise relative error, then the summary statistics' relative error:
    # each after the one before, never ranked as one number (as ``top_offenders`` orders them)
    keys = []
    for k in ("rounding_units", "max_rel_err", "summary_rel_err"):
        v = c.get(k)
        v = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
        keys.append((v is None, -(v or 0.0)))
    return (rank, *keys, c.get("seq") or 0)


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
    out += ["", "First non-finite producer:"]
    intended = report.get("intended_nonfinite") or {}
    for run, f in report["first_nonfinite"].items():
        masks = intended.get(run) or []
        if f is None:
            out.append(f"  {run}: none (every recorded value is finite)" if not masks else
                       f"  {run}: none (the only non-finite values are -inf written on purpose by "
                       f"{len(masks)} op(s) (a mask, or log(0)), e.g. {masks[0]['op']})")
            continue
        out.append(f"  {run}: {f['op']}  (step {f['step']}, rank {f['rank']}, seq {f['seq']}, {f['role']} {f['index']})")
        out.append(f"    {f['reason']}")
        if f.get("location"):
            out.append(f"    called from {f['location']}")
        chain = " -> ".join(p["op"] for p in f["path"])
        out.append(f"    path ({order_text(f.get('order'))}): {chain}")
    arts = report.get("norm_artefacts") or []
    out += _listing(f"Norm artefacts ({len(arts)}): not non-finite values", top,
                    [f"{a['run']}: {a['op']} {a['role']} {a['index']}: {a['reason']}" for a in arts])
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
        # a comparison on summary statistics has no element-wise error: its own columns, where there is one
        by_summary = any(c.get("basis") == "stats" for c in worst)
        rows = [[c["cand_run"], c["op"], f"{c['role']}.{c['index']}", c["match"], c["basis"] or "-",
                 num_text(c["max_abs_err"]), num_text(c["max_rel_err"])]
                + ([num_text(c.get("summary_abs_err")), num_text(c.get("summary_rel_err"))] if by_summary else [])
                + [num_text(c["cosine"]) if c["cosine"] is None or c["cosine_deficit"] is None
                   else f"1-{num_text(c['cosine_deficit'])}",
                   num_text(c["sqnr_db"]), str(c["nonfinite_introduced"]), c["verdict"]] for c in worst]
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
