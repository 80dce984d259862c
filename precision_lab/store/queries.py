"""Every read the project makes of the database, as named functions.

Each function takes a ``Store`` first and returns typed rows (``store.rows``,
``records``, ``fixes.facts``, the origin's records), plain values, or a
DataFrame where a page wants one.  Nothing outside ``precision_lab.store``
writes SQL; a use case that needs a new question adds a function here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, TypeVar

from ..fixes.facts import (ErrorGrowth, FinalOutput, LocalError, OpSeen, PairedValues, QuantiseCall, StateAfter,
                           ZeroGradient)
from ..enums import Severity
from ..records import Diagnosis, RunInfo, StoredRecord
from ..origin.values import ComparedRecord, NonfiniteCall, PathStep
from .ranking import rank_case
from .rows import (DiagnosisRow, ForwardEnds, ForwardOpCall, NamedRecord, OpExtreme, OpParents, RecordIds, RecordOfRun,
                   RecordWithData, ReferenceRecords, SessionListRow, WarningRow, one_as, records_as, rows_as)

__all__ = [
    "rows", "session_list", "session_runs", "op_records", "module_call", "reference_of", "first_nonfinite_output_of_type",
    "warning_starting", "ops_above", "worst_local_errors", "last_accumulated_output", "worst_gradient_sqnr", "session_data_version",
    "last_forward_output_finite", "run_sources", "forward_ops", "op_extremes", "op_output_rid", "run_order",
    "forward_ends", "run_records_with_data", "diagnoses_worst_first",
]


D = TypeVar("D", bound=Diagnosis)


def rows(store, sql: str, params: Optional[list] = None) -> list[dict]:
    """Rows of ``sql`` as dicts keyed by column name: the store's own reading of a query it answers in its own
    terms (the functions here give every other layer typed rows)."""
    cur = store.sql(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _one(store, sql: str, params: list) -> Optional[dict]:
    got = rows(store, sql, params)
    return got[0] if got else None


def _like_prefix(text: str) -> str:
    """``text`` escaped for ``LIKE ... ESCAPE '\\'`` (so ``_`` and ``%`` in module names match literally)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# ---- runs and tensors ---------------------------------------------------------------

def run_order(alias: str = "") -> str:
    """ORDER BY terms listing runs in the order they were added: by ``created`` (to the second), then by insertion
    (DuckDB's ``rowid``, kept in order through deletes and imports), so two re-runs made in the same second keep
    their order; ``alias``: the runs table's alias in the query."""
    a = f"{alias}." if alias else ""
    return f"{a}created, {a}rowid"


def session_list(store) -> list[SessionListRow]:
    """Every session, newest first, with how many runs each holds."""
    return rows_as(SessionListRow, store.sql(
        "SELECT s.session_id, s.name, s.created, s.source, s.recipe, (SELECT count(*) FROM runs r "
        "WHERE r.session_id = s.session_id) AS runs FROM sessions s ORDER BY s.created DESC, s.name"))


def session_runs(store, session_id: str, *, references_first: bool = False) -> list[RunInfo]:
    """The runs of a session, oldest first (with ``references_first``: reference runs, then the rest in the
    order they were added)."""
    first = "kind <> 'reference', " if references_first else ""
    return rows_as(RunInfo, store.sql(f"SELECT * FROM runs WHERE session_id = ? ORDER BY {first}{run_order()}",
                                      [session_id]))


def run_row(store, run_id: str) -> Optional[RunInfo]:
    """One run's row, or None."""
    return one_as(RunInfo, store.sql("SELECT * FROM runs WHERE run_id = ?", [run_id]))


def op_records(store, run_id: str, op: str, step: int, rank: int) -> list[NamedRecord]:
    """Every record of one op call, in execution order."""
    return records_as(NamedRecord, store.sql("""SELECT * FROM tensors WHERE run_id = ? AND op = ? AND step = ?
                                                AND rank = ? ORDER BY seq, rid""", [run_id, op, step, rank]))


def module_call(store, run_id: str, module: str, step: int, rank: int, seq: int, *,
                after: bool = True) -> list[NamedRecord]:
    """Records of one call of ``module`` (named ``<module>.forward.<n>``).

    With ``after`` the call that encloses ``seq`` (its record comes after its
    children's, so the first call at or after ``seq``), else the last call at
    or before ``seq``.
    """
    like = _like_prefix(module) + ".forward.%"
    cmp, order = (">=", "ASC") if after else ("<=", "DESC")
    hit = _one(store, f"""SELECT op, min(seq) AS s FROM tensors WHERE run_id = ? AND step = ? AND rank = ?
                          AND op LIKE ? ESCAPE '\\' GROUP BY op HAVING min(seq) {cmp} ?
                          ORDER BY s {order} LIMIT 1""", [run_id, step, rank, like, seq])
    if hit is None:
        return []
    return op_records(store, run_id, hit["op"], step, rank)


def _first_record(store, sql: str, params: list) -> Optional[NamedRecord]:
    got = records_as(NamedRecord, store.sql(sql, params))
    return got[0] if got else None


def reference_of(store, cand_run_id: str, recs: Sequence[StoredRecord], ref_run_id: str) -> ReferenceRecords:
    """Reference records paired with the candidate records ``recs``, by candidate rid.

    The stored comparisons decide first; records they do not cover are
    matched by (op, role, index, step, rank).
    """
    out: dict[int, NamedRecord] = {}
    if not recs:
        return ReferenceRecords(out)
    rids = [int(r.rid) for r in recs]
    q = ",".join("?" * len(rids))
    for c in rows(store, f"""SELECT cand_rid, ref_rid FROM comparisons WHERE cand_run_id = ? AND cand_rid IN ({q})
                             AND ref_rid IS NOT NULL""", [cand_run_id] + rids):
        ref = _first_record(store, "SELECT * FROM tensors WHERE run_id = ? AND rid = ?", [ref_run_id, c["ref_rid"]])
        if ref is not None:
            out[int(c["cand_rid"])] = ref
    for r in recs:
        if int(r.rid) in out:
            continue
        ref = _first_record(store, """SELECT * FROM tensors WHERE run_id = ? AND op = ? AND role = ? AND "index" = ?
                                      AND step = ? AND rank = ? LIMIT 1""",
                            [ref_run_id, r.op, r.role, r.index, r.step, r.rank])
        if ref is not None:
            out[int(r.rid)] = ref
    return ReferenceRecords(out)


def first_nonfinite_output_of_type(store, run_id: str, op_type: str) -> Optional[str]:
    """The first op of ``op_type`` whose output holds NaN or inf, else None."""
    hit = _one(store, """SELECT op FROM tensors WHERE run_id = ? AND op_type = ? AND role = 'output'
                         AND nonfinite ORDER BY seq LIMIT 1""", [run_id, op_type])
    return hit["op"] if hit else None


def warning_starting(store, run_id: str, prefix: str) -> Optional[str]:
    """The first warning of a run whose message starts with ``prefix``."""
    hit = _one(store, "SELECT message FROM warnings WHERE run_id = ? AND message LIKE ? ESCAPE '\\' LIMIT 1",
               [run_id, _like_prefix(prefix) + "%"])
    return hit["message"] if hit else None


def ops_above(store, run_id: str, absmax: float) -> list[OpSeen]:
    """The ops whose inputs or outputs exceed ``absmax``, in execution order."""
    return rows_as(OpSeen, store.sql("""SELECT op, min(seq) AS seq FROM tensors
                          WHERE run_id = ? AND role IN ('input', 'output')
                          AND absmax > ? GROUP BY op ORDER BY seq""", [run_id, absmax]))


# a capture's module call (``<path>.forward.<n>``, the root's ``forward.<n>``): true sorts after false
_MODULE_CALL = r"regexp_matches(op, '(^|\.)(forward|backward)\.[0-9]+$')"


def worst_local_errors(store, run_id: str, limit: int) -> list[LocalError]:
    """Outputs whose local (shadow) error is judged an error, worst first; an op before the module calls that
    hold it (a module's local error adds up its ops')."""
    return rows_as(LocalError, store.sql(f"""SELECT op, seq, rounding_units, sqnr_db, cand_format FROM comparisons
                           WHERE cand_run_id = ? AND kind = 'local' AND verdict = 'error' AND role = 'output'
                           ORDER BY {_MODULE_CALL}, rounding_units DESC LIMIT ?""", [run_id, int(limit)]))


def last_accumulated_output(store, run_id: str) -> Optional[FinalOutput]:
    """The run's last output compared with the reference, the model's output: its ``sqnr_db`` is None when that
    output holds NaN/Inf the reference does not, never the SQNR of its finite values nor an earlier op's standing
    in for it."""
    # a model with several outputs (a loss and its logits): the largest, then the first returned
    return one_as(FinalOutput, store.sql("""SELECT c.op, c.seq,
                          CASE WHEN c.nonfinite_introduced > 0 THEN NULL ELSE c.sqnr_db END AS sqnr_db,
                          c.verdict, c.nonfinite_introduced FROM comparisons c JOIN tensors t ON t.rid = c.cand_rid
                          WHERE c.cand_run_id = ? AND c.kind = 'accumulated' AND c.role = 'output'
                          AND c.ref_rid IS NOT NULL AND c.cand_rid IS NOT NULL
                          ORDER BY c.step DESC, c.seq DESC, t.numel DESC, c.cand_rid LIMIT 1""", [run_id]))


def worst_gradient_sqnr(store, run_id: str) -> Optional[float]:
    """The lowest SQNR (dB) against the reference of the run's parameter gradients (what the optimizer uses), None
    when it compared none or one holds NaN/Inf the reference does not (-inf dB then stands for it)."""
    row = _one(store, """SELECT count(*) AS n, min(CASE WHEN nonfinite_introduced > 0 THEN '-inf'::DOUBLE
                                                  ELSE sqnr_db END) AS worst
                         FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated' AND role = 'param_grad'
                         AND ref_rid IS NOT NULL AND cand_rid IS NOT NULL""", [run_id])
    return None if row is None or not row["n"] or row["worst"] is None else float(row["worst"])


def last_forward_output_finite(store, run_id: str) -> bool:
    """Whether the run's last forward output (the model's output) is finite."""
    last = _one(store, """SELECT nonfinite FROM tensors WHERE run_id = ? AND role = 'output'
                          AND direction = 'forward' ORDER BY step DESC, seq DESC LIMIT 1""", [run_id])
    return last is not None and not last["nonfinite"]


def run_sources(store, session_id: str) -> list[str]:
    """The distinct non-empty ``source`` values of a session's runs."""
    return [r["source"] for r in rows(store, "SELECT DISTINCT source FROM runs WHERE session_id = ?", [session_id])
            if r["source"]]


def forward_ops(store, run_id: str) -> list[ForwardOpCall]:
    """Every forward op call of a run, in execution order."""
    return rows_as(ForwardOpCall, store.sql("""SELECT op, any_value(op_type) AS op_type, min(seq) AS seq,
                                                      bool_or(nonfinite) AS nonfinite
                                               FROM tensors WHERE run_id = ? AND direction = 'forward'
                                               GROUP BY step, rank, op ORDER BY min(step), min(seq)""", [run_id]))


def _in(roles: Sequence[str]) -> str:
    """A SQL list literal of role names (they come from the code, never from a user)."""
    return "(" + ", ".join("'" + r.replace("'", "''") + "'" for r in roles) + ")"


def nonfinite_op_calls(store, run_id: str, input_roles: Sequence[str]) -> list[NonfiniteCall]:
    """Op calls holding any NaN/inf, in execution order (``no_inputs``: the call has no record of
    ``input_roles``)."""
    ins = _in(input_roles)
    return records_as(NonfiniteCall, store.sql(f"""
                           SELECT step, rank, op, min(seq) AS seq, any_value(op_type) AS op_type,
                                  any_value(direction) AS direction,
                                  NOT bool_or(role IN {ins}) AS no_inputs
                           FROM tensors WHERE run_id = ?
                           GROUP BY step, rank, op
                           HAVING bool_or(nonfinite)
                           ORDER BY step, seq, rank, op""", [run_id]))


def quantise_calls(store, run_id: str, op_types: Sequence[str]) -> list[QuantiseCall]:
    """Each call of a quantise op (``op_types``: the names it goes by) with its first input (and that input's
    histogram) and first output record, and the max of the output of the ``<path>.amax`` call it made, where
    recorded, in execution order."""
    recs = rows(store, f"""SELECT * FROM tensors WHERE run_id = ? AND role IN ('input', 'output')
                             AND op IN (SELECT op FROM tensors WHERE run_id = ? AND op_type IN {_in(op_types)})
                           ORDER BY step, rank, seq, role, "index" """, [run_id, run_id])
    if not recs:
        return []
    calls: dict[tuple, dict] = {}
    for r in recs:
        c = calls.setdefault((r["step"], r["rank"], r["op"]), {"op": r["op"], "step": r["step"], "rank": r["rank"],
                                                                "seq": r["seq"], "input": None, "output": None})
        c[r["role"]] = c[r["role"]] or r
    # the first output of each call's "<path>.amax" module at or after the call starts: the value the scale was
    # built from (one query for the run's amax outputs)
    amaxes = rows(store, """SELECT op, step, rank, seq, max FROM tensors WHERE run_id = ? AND role = 'output'
                            AND regexp_matches(op, '\\.amax\\.forward\\.[0-9]+$') ORDER BY seq""", [run_id])
    out = []
    for c in sorted(calls.values(), key=lambda c: (c["step"], c["seq"], c["rank"])):
        if c["input"] is None or c["output"] is None:
            continue
        prefix = c["op"].rsplit(".forward.", 1)[0] + ".amax.forward."
        amax = next((a["max"] for a in amaxes if (a["step"], a["rank"]) == (c["step"], c["rank"])
                     and a["seq"] >= c["seq"] and a["op"].startswith(prefix)), None)
        out.append(QuantiseCall(c["op"], int(c["step"]), int(c["rank"]), int(c["seq"]),
                                StoredRecord.from_row(c["input"], store.histogram(run_id, c["input"]["rid"])),
                                StoredRecord.from_row(c["output"]), amax))
    return out


def error_growth(store, run_id: str) -> list[ErrorGrowth]:
    """Per op call of a run, its output's accumulated error against the reference beside its inputs', both in
    unit roundoffs of the candidate format (element-wise comparisons only), in execution order; module calls
    left out (their error is their ops')."""
    return rows_as(ErrorGrowth, store.sql(f"""
                           SELECT c.op, any_value(t.op_type) AS op_type, c.step, c.rank, min(c.seq) AS seq,
                                  max(c.rounding_units) FILTER (WHERE c.role = 'output') AS out_units,
                                  max(c.rounding_units) FILTER (WHERE c.role IN ('input', 'kwarg')) AS in_units,
                                  max(c.max_abs_err) FILTER (WHERE c.role = 'output') AS out_abs_err,
                                  max(t.absmax) FILTER (WHERE c.role = 'output') AS out_absmax,
                                  min(t.absmax) FILTER (WHERE c.role IN ('input', 'kwarg')) AS in_absmax,
                                  any_value(c.cand_format) AS cand_format
                           FROM comparisons c JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                           WHERE c.cand_run_id = ? AND c.kind = 'accumulated' AND c.basis = 'tensor'
                             AND c.rounding_units IS NOT NULL AND NOT {_MODULE_CALL.replace("op", "c.op", 1)}
                           GROUP BY c.op, c.step, c.rank
                           HAVING out_units IS NOT NULL AND in_units IS NOT NULL
                           ORDER BY c.step, seq, c.rank""", [run_id]))


def paired_values(store, run_id: str, roles: Sequence[str],
                  op_types: Optional[Sequence[str]] = None) -> list[PairedValues]:
    """The run's records of ``roles`` (of ops of ``op_types`` when given) compared element-wise with the
    reference, beside the reference's, in execution order."""
    types = f"AND t.op_type IN {_in(op_types)}" if op_types else ""
    return rows_as(PairedValues, store.sql(f"""
                           SELECT c.op, t.op_type, c.step, c.rank, c.seq, c.role, c."index", t.dtype, t.numel,
                                  t.min, t.max, t.absmax, t.zero_count, rt.min AS ref_min, rt.max AS ref_max,
                                  rt.absmax AS ref_absmax, rt.zero_count AS ref_zero_count,
                                  rt.min_abs_nonzero AS ref_min_abs_nonzero
                           FROM comparisons c JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                           JOIN tensors rt ON rt.run_id = c.ref_run_id AND rt.rid = c.ref_rid
                           WHERE c.cand_run_id = ? AND c.kind = 'accumulated' AND c.basis = 'tensor'
                             AND c.role IN {_in(roles)} {types}
                           ORDER BY c.step, c.seq, c.rank, c.op, c.role, c."index" """, [run_id]))


def first_nonfinite_state_after(store, run_id: str, step: int) -> Optional[StateAfter]:
    """The first parameter or buffer record holding NaN/inf at a step after ``step``, or None."""
    return one_as(StateAfter, store.sql("""SELECT op, "index", step, nan_count, inf_count,
                                 count(*) OVER (PARTITION BY step) AS count
                          FROM tensors WHERE run_id = ? AND step > ? AND role IN ('param', 'buffer') AND nonfinite
                          ORDER BY step, seq, rid LIMIT 1""", [run_id, int(step)]))


def records_inputs(store, run_id: str, input_roles: Sequence[str]) -> bool:
    """Whether a run holds any input record (an outputs-only dump holds none)."""
    return _one(store, f"SELECT 1 AS x FROM tensors WHERE run_id = ? AND role IN {_in(input_roles)} LIMIT 1",
                [run_id]) is not None


def nonfinite_records(store, run_id: str) -> list[ComparedRecord]:
    """Every non-finite record of a run with its stored comparison against a reference, in execution order."""
    return records_as(ComparedRecord, store.sql("""
                          SELECT t.*, c.nonfinite_introduced AS introduced, c.masked AS masked, c.match AS match,
                                 rt.absmax AS ref_absmax, rt.nonfinite AS ref_nonfinite
                          FROM tensors t
                          LEFT JOIN comparisons c ON c.cand_run_id = t.run_id AND c.cand_rid = t.rid
                               AND c.kind = 'accumulated' AND c.ref_rid IS NOT NULL
                          LEFT JOIN tensors rt ON rt.run_id = c.ref_run_id AND rt.rid = c.ref_rid
                          WHERE t.run_id = ? AND t.nonfinite
                          ORDER BY t.step, t.seq, t.rank, t.rid""", [run_id]))


# what a dump calls the model's own output when its records do not nest by name (``model.npy`` beside
# ``layers.0.npy``); a record named like a class (``GPT2Model``) is a root too (``forward_ends``)
ROOT_NAMES = ("model", "root", "output", "outputs", "logits", "net", "network", "module")


def forward_ends(store, run_id: str) -> list[ForwardEnds]:
    """Per step and rank, the forward op calls with an output record that start first and last in execution
    order (``ForwardEnds``: op names); one of them returned the model's output (the
    one holding the other, else the last).  ``named_root`` is a record named as a model's output is
    (``ROOT_NAMES``, or a class name: a dotless name that begins with a capital), for a dump whose records
    neither nest nor come in a known order.  A run that records no outputs has no row."""
    names = ", ".join("?" * len(ROOT_NAMES))
    return rows_as(ForwardEnds, store.sql(f"""SELECT step, rank, arg_min(op, seq) AS first, arg_max(op, seq) AS last,
                                  min(op) FILTER (WHERE lower(op) IN ({names})
                                                  OR regexp_full_match(op, '[A-Z][A-Za-z0-9_]*')) AS named_root
                           FROM tensors
                           WHERE run_id = ? AND coalesce(direction, 'forward') <> 'backward'
                             AND role IN ('output', 'tensor')
                           GROUP BY step, rank ORDER BY step, rank""", [*ROOT_NAMES, run_id]))


def op_parents(store, run_id: str) -> OpParents:
    """The module call each op ran inside, for the ops whose dump says so (msprobe's construct.json)."""
    return OpParents({r["op"]: r["parent"] for r in rows(store, """SELECT op, any_value(parent) AS parent FROM tensors
                                                                   WHERE run_id = ? AND parent IS NOT NULL
                                                                   GROUP BY op""", [run_id])})


def op_calls_up_to(store, run_id: str, step: int, rank: int, seq: int, input_roles: Sequence[str],
                   limit: int) -> list[PathStep]:
    """The last ``limit`` op calls starting at or before ``seq``, latest first."""
    ins = _in(input_roles)
    return rows_as(PathStep, store.sql(f"""SELECT op, any_value(op_type) AS op_type, min(seq) AS seq,
                                  coalesce(bool_or(nonfinite AND role IN {ins}), false) AS nonfinite_in,
                                  coalesce(bool_or(nonfinite AND role NOT IN {ins}), false) AS nonfinite_out
                           FROM tensors WHERE run_id = ? AND step = ? AND rank = ?
                           GROUP BY op HAVING min(seq) <= ?
                           ORDER BY seq DESC, op DESC LIMIT ?""", [run_id, step, rank, seq, int(limit)]))


def nonfinite_norms_of_finite_values(store, session_id: str) -> list[RecordOfRun]:
    """Records whose stored Norm or Mean is NaN/inf while their min and max are finite."""
    return records_as(RecordOfRun, store.sql("""SELECT t.*, r.name AS run, r.kind AS run_kind, r.dtype AS run_dtype,
                                 r.session_id
                          FROM tensors t JOIN runs r ON r.run_id = t.run_id
                          WHERE r.session_id = ? AND NOT t.nonfinite AND t.min IS NOT NULL AND t.max IS NOT NULL
                            AND coalesce(t.numel, 1) > 0 AND NOT isnan(t.min) AND NOT isnan(t.max)
                            AND (isnan(t.l2norm) OR isinf(t.l2norm) OR isnan(t.mean) OR isinf(t.mean))
                          ORDER BY r.name, t.step, t.seq, t.rank, t.rid""", [session_id]))


def _columns(names: Sequence[str]) -> str:
    for n in names:
        if not n.replace("_", "").isalnum():
            raise ValueError(f"not a column name: {n!r}")
    return ", ".join(f'"{n}"' for n in names)


def run_tensors(store, run_id: str, columns: Sequence[str]) -> list[tuple]:
    """Every record of a run, in (step, rank, seq) order, as a tuple of the values of ``columns`` in their order."""
    return store.sql(f"SELECT {_columns(columns)} FROM tensors WHERE run_id = ? ORDER BY step, rank, seq, rid",
                     [run_id]).fetchall()


def run_records_with_data(store, run_id: str) -> list[RecordWithData]:
    """Every record of a run with its kept tensor's ``.npy`` bytes as ``npy`` (None where none was kept), in
    (step, rank, seq) order."""
    return records_as(RecordWithData, store.sql("""SELECT t.*, d.npy AS npy FROM tensors t LEFT JOIN tensor_data d
                                                   ON d.run_id = t.run_id AND d.rid = t.rid
                                                   WHERE t.run_id = ? ORDER BY t.step, t.rank, t.seq, t.rid""",
                                                [run_id]))


def session_comparisons(store, session_id: str, columns: Sequence[str]) -> list[tuple]:
    """Every comparison of a session, by candidate run and execution order, as a tuple of the values of ``columns``
    in their order."""
    return store.sql(f"""SELECT {_columns(columns)} FROM comparisons WHERE session_id = ?
                         ORDER BY cand_run_id, step, rank, seq, op, role, "index" """, [session_id]).fetchall()


def session_data_version(store, session_id: str) -> tuple:
    """What every view of one session depends on, in one query: its runs (a re-run adds one; stored records
    never change) and its diagnoses (rewritten after each write, so a digest of their content)."""
    row = _one(store, """SELECT (SELECT string_agg(run_id, ',' ORDER BY run_id) FROM runs WHERE session_id = ?) AS runs,
                                (SELECT count(*) FROM diagnoses WHERE session_id = ?) AS n,
                                (SELECT md5(string_agg(concat_ws('|', run_id, rule, op, message, fixes, severity, seq),
                                                       '\n' ORDER BY run_id, seq, op, rule, message))
                                 FROM diagnoses WHERE session_id = ?) AS diagnoses""", [session_id] * 3)
    return tuple(row.values()) if row else ()


def diagnosis_rows(store, cls: type[D], sql: str, params: list) -> list[D]:
    """Rows of diagnoses as ``cls`` (``Diagnosis`` or a subclass) with ``fixes`` decoded to a tuple, best first
    (``Diagnosis.decode_fixes``)."""
    return [dataclasses.replace(d, fixes=Diagnosis.decode_fixes(d.fixes))
            for d in rows_as(cls, store.sql(sql, params))]


def session_diagnoses(store, session_id: str) -> list[Diagnosis]:
    """Every diagnosis of a session, by run and execution order."""
    return diagnosis_rows(store, Diagnosis, "SELECT * FROM diagnoses WHERE session_id = ? ORDER BY run_id, seq, op",
                          [session_id])


def session_warning_rows(store, session_id: str) -> list[WarningRow]:
    """Every warning of a session, by file."""
    return rows_as(WarningRow, store.sql("SELECT * FROM warnings WHERE session_id = ? ORDER BY file", [session_id]))


def zero_gradients(store, run_id: str) -> list[ZeroGradient]:
    """Parameter gradients of a run that are 0 in every element, in execution order, each with the gradient that
    arrived at the same backward op call (its ``grad_output``): ``arriving_absmax`` and ``arriving_smallest``,
    its largest and smallest nonzero magnitudes (NULL where none arrived or it was all zero)."""
    return rows_as(ZeroGradient, store.sql("""
        SELECT p.op, p.step, p.rank, p.seq, p."index", p.dtype, p.numel,
               max(g.absmax) AS arriving_absmax, min(g.min_abs_nonzero) AS arriving_smallest
        FROM tensors p LEFT JOIN tensors g ON g.run_id = p.run_id AND g.op = p.op AND g.step = p.step
             AND g.rank = p.rank AND g.role = 'grad_output' AND g.zero_count < g.numel
        WHERE p.run_id = ? AND p.role = 'param_grad' AND p.numel > 0 AND p.zero_count = p.numel
        GROUP BY p.rid, p.op, p.step, p.rank, p.seq, p."index", p.dtype, p.numel
        ORDER BY p.step, p.rank, p.seq, p.rid""", [run_id]))


def run_ranks(store, run_id: str) -> list[int]:
    """The ranks a run recorded, in order."""
    return [int(r["rank"]) for r in rows(store, "SELECT DISTINCT rank FROM tensors WHERE run_id = ? ORDER BY rank",
                                         [run_id])]


def record_ids_by_name(store, run_id: str) -> RecordIds:
    """The record ids of every record of a run, by ``(step, rank, name)``."""
    return RecordIds({(int(step), int(rank), name): int(rid) for step, rank, name, rid in
                      store.sql("SELECT step, rank, name, rid FROM tensors WHERE run_id = ?", [run_id]).fetchall()})


def count_records(store, run_id: str, *, nonfinite: Optional[bool] = None, direction: Optional[str] = None) -> int:
    """How many records a run holds (only non-finite ones, or one direction, when asked)."""
    sql, params = "SELECT count(*) AS n FROM tensors WHERE run_id = ?", [run_id]
    if nonfinite is not None:
        sql += " AND nonfinite = ?"
        params.append(bool(nonfinite))
    if direction is not None:
        sql += " AND direction = ?"
        params.append(direction)
    return int(rows(store, sql, params)[0]["n"])


def ops_by_local_error(store, run_id: str) -> list[str]:
    """Ops of a run's judged local comparisons, worst first (non-finite introduced, then ops before module
    calls, then rounding units)."""
    return [r["op"] for r in rows(store, f"""SELECT op FROM comparisons
                                             WHERE cand_run_id = ? AND kind = 'local' AND role = 'output'
                                               AND verdict IS NOT NULL
                                             ORDER BY nonfinite_introduced DESC, {_MODULE_CALL},
                                                      rounding_units DESC NULLS LAST, seq""",
                                  [run_id])]


def run_diagnoses(store, run_id: str) -> list[Diagnosis]:
    """A run's diagnoses in execution order."""
    return diagnosis_rows(store, Diagnosis, "SELECT * FROM diagnoses WHERE run_id = ? ORDER BY seq", [run_id])


def op_extremes(store, run_id: str, fmt_max: float) -> list[OpExtreme]:
    """Per op of a run (forward outputs): the smallest headroom below ``fmt_max`` (log2(fmt_max / absmax)
    over finite values), whether it held a non-finite value, its enclosing call (``parent``), first seq and
    op type."""
    return rows_as(OpExtreme, store.sql("""
        SELECT op, min(log2(? / nullif(absmax, 0))) AS headroom, bool_or(nonfinite) AS nonfinite,
               any_value(parent) AS parent, min(seq) AS seq, any_value(op_type) AS op_type
        FROM tensors WHERE run_id = ? AND direction = 'forward' AND role = 'output' GROUP BY op""",
                [fmt_max, run_id]))


def op_output_rid(store, run_id: str, op: str) -> Optional[int]:
    """The rid of ``op``'s output to open first: its first non-finite forward output, else its first one."""
    got = store.sql("""SELECT rid FROM tensors WHERE run_id = ? AND op = ? AND role = 'output'
                       ORDER BY nonfinite DESC, step, rank, seq, "index" LIMIT 1""", [run_id, op]).fetchone()
    return None if got is None else int(got[0])


def diagnoses_worst_first(store, session_id: str) -> list[DiagnosisRow]:
    """A session's stored diagnoses with their run's name, errors first, then by execution order."""
    return diagnosis_rows(store, DiagnosisRow, f"""SELECT d.*, r.name AS run FROM diagnoses d LEFT JOIN runs r ON r.run_id = d.run_id
                           WHERE d.session_id = ?
                           ORDER BY {rank_case("d.severity", Severity, worst_first_order=True)}, d.seq, d.op""",
                [session_id])
