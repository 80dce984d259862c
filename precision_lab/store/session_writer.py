"""One session's rows as a write adds them: runs, records, histograms, kept tensors, comparisons, diagnoses,
warnings and a long run's timeline, buffered and appended in batches inside the session's transaction."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import datetime, timezone
from typing import Iterable, Optional

from ..display import visible
from ..enums import RunOrder, Verdict
from ..records import (Diagnosis, RunInfo, StepScalar, TensorRecord, TimelineRow, TimelineShare, dataclass_columns,
                       free_name, npy_bytes, record_column_values)
from ..stats import HIST_EDGES_ID, hist_list_arrays
from .schema import comparison_columns, tensor_columns

_ORDERS = RunOrder.words()  # the orders a run's records may be stored in


def now_text() -> str:
    """The time now (UTC) as the store writes it: when a session or run was made, or diagnosed."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


class SessionWriter:
    """Buffers rows and appends them in batches inside the session's transaction."""

    BATCH = 20_000
    # records buffered before their rows are made: each keeps its dense histogram (2.6 KB) until then
    RECORD_BATCH = 4096

    def __init__(self, store, cur, session_id: str, name: str):
        self.store, self.cur, self._session_id, self._name = store, cur, session_id, name
        self._pending = None  # the session's insert into its file, still running (``writer.PendingInsert``)
        self._records: list[tuple] = []  # (record as added, its rid), made into tensors and histograms rows on flush
        self._cmps: list[list] = []  # comparison rows, inserted in batches (one INSERT per row costs ~5 ms)
        # warning rows, batched too: a dump can warn once per record (one INSERT per row costs ~0.6 ms)
        self._warns: list[tuple] = []
        self._timeline: dict[str, list] = {"timeline": [], "timeline_formats": [], "step_scalars": []}
        self._next_rid: dict[str, int] = {}
        self._cols = [n for n, _ in tensor_columns()]

    @property
    def name(self) -> str:
        """The session's name: once its block has ended, the one it got in the database (made unique as it is
        inserted; a write still running is waited for, and its failure raised)."""
        self._settle()
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    @property
    def session_id(self) -> str:
        self._settle()
        return self._session_id

    @session_id.setter
    def session_id(self, value: str) -> None:
        self._session_id = value

    def if_failed(self, fn) -> None:
        """Run ``fn()`` if the session does not reach its file (an insert still running fails)."""
        if self._pending is not None:
            self._pending.if_failed(fn)

    def _settle(self) -> None:
        if self._pending is not None:
            self._name, self._session_id = self._pending.result()
            self._pending = None

    def free_run_name(self, base: str) -> str:
        """``base``, or ``base (2)``, ``(3)``... when a run of this session has it: read inside this write's
        transaction, so two writers that ran the same fix at once still get two names."""
        taken = {r[0] for r in self.cur.execute("SELECT name FROM runs WHERE session_id = ?",
                                                [self.session_id]).fetchall()}
        return free_name(base, taken, "{base} ({i})")

    def add_run(self, run: RunInfo | None = None, **kw) -> str:
        if run is None:
            run = RunInfo(run_id=kw.pop("run_id", None) or uuid.uuid4().hex[:12], session_id=self.session_id, **kw)
        run = dataclasses.replace(run, session_id=self.session_id, created=run.created or now_text())
        if run.order is not None and run.order not in _ORDERS:  # every reader checks; the store holds no other
            raise ValueError(f"run {visible(str(run.name))[:80]!r}: order {visible(str(run.order))[:40]!r} is not one "
                             f"of {', '.join(_ORDERS)}")
        self._undiagnosed()
        cols = [f.name for f in dataclasses.fields(RunInfo)]
        self.cur.execute(
            f"INSERT INTO runs ({', '.join(chr(34) + c + chr(34) for c in cols)}) VALUES ({', '.join('?' * len(cols))})",
            [getattr(run, c) for c in cols],
        )
        self._next_rid.setdefault(run.run_id, int(self.cur.execute(
            # fetchall: a half-read result would block the cursor's next register() in flush()
            "SELECT coalesce(max(rid) + 1, 0) FROM tensors WHERE run_id = ?", [run.run_id]).fetchall()[0][0]))
        return run.run_id

    def add_record(self, rec: TensorRecord, *, keep_tensor=None) -> int:
        """Append one record; returns its rid (unique within the run)."""
        return self.add_records([rec], keep_tensors=None if keep_tensor is None else [keep_tensor])[0]

    def add_records(self, records, *, keep_tensors=None) -> list[int]:
        """Append records (their statistics computed); returns their rids (unique within each run).  Each is kept
        as it is now (a shallow copy: a caller may rebind its fields afterwards) and made into rows a column at a
        time when the writer flushes.  ``keep_tensors``: the tensor to store for each record instead of its own."""
        rids = []
        for i, rec in enumerate(records):
            if rec.run_id not in self._next_rid:
                raise KeyError(f"run {rec.run_id!r} was not added to session {self.name!r}")
            rid = self._next_rid[rec.run_id]
            self._next_rid[rec.run_id] = rid + 1
            rids.append(rid)
            kept = object.__new__(type(rec))  # a shallow copy (``copy.copy`` takes five times as long)
            kept.__dict__.update(rec.__dict__, tensor=None)  # the tensor is stored below, if at all: not kept
            self._records.append((kept, rid))
            tensor = keep_tensors[i] if keep_tensors is not None and keep_tensors[i] is not None else rec.tensor
            if tensor is not None:
                self.cur.execute("INSERT INTO tensor_data VALUES (?, ?, ?)", [rec.run_id, rid, npy_bytes(tensor)])
            if len(self._records) >= self.RECORD_BATCH:
                self.flush()
        return rids

    def flush(self) -> None:
        import pyarrow as pa

        if self._records:
            records = [r for r, _ in self._records]
            values = record_column_values(records, [c for c in self._cols if c != "rid"]).by_name
            values["rid"] = [rid for _, rid in self._records]
            self._insert("tensors", self._cols, pa.table({c: values[c] for c in self._cols}))
            with_hist = [(r, rid) for r, rid in self._records if r.stats.hist is not None]
            self._records.clear()
            if with_hist:
                bins, counts = hist_list_arrays([r.stats.hist for r, _ in with_hist])
                self._insert("histograms", ("run_id", "rid", "edges_id", "bins", "counts"), pa.table({
                    "run_id": [r.run_id for r, _ in with_hist], "rid": [rid for _, rid in with_hist],
                    "edges_id": [HIST_EDGES_ID] * len(with_hist), "bins": bins, "counts": counts}))
        if self._cmps:
            cols = [n for n, _ in comparison_columns()]
            self._insert("comparisons", cols, pa.table({c: [r[i] for r in self._cmps] for i, c in enumerate(cols)}))
            self._cmps.clear()
        if self._warns:
            cols = ("session_id", "run_id", "file", "message")
            self._insert("warnings", cols, pa.table({c: [r[i] for r in self._warns] for i, c in enumerate(cols)},
                                                    schema=pa.schema([(c, pa.string()) for c in cols])))
            self._warns.clear()
        self._flush_timeline()

    def _insert(self, table: str, columns, rows) -> None:
        """Append the Arrow table ``rows`` to ``table``: its ``columns``, by name."""
        names = ", ".join(chr(34) + c + chr(34) for c in columns)
        self.cur.register("_pl_rows", rows)
        self.cur.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM _pl_rows")
        self.cur.unregister("_pl_rows")

    def add_timeline(self, rows: Iterable[TimelineRow] = (), shares: Iterable[TimelineShare] = (),
                     scalars: Iterable[StepScalar] = ()) -> None:
        """Append a long run's per-step summaries (see ``TimelineRow``)."""
        for table, items in (("timeline", rows), ("timeline_formats", shares), ("step_scalars", scalars)):
            self._timeline[table].extend(items)
        if sum(len(v) for v in self._timeline.values()) >= self.BATCH:
            self.flush()

    def add_timeline_tables(self, **tables) -> None:
        """Append a long run's per-step summaries given as Arrow tables (``timeline``, ``timeline_formats``,
        ``step_scalars``: each with its dataclass's columns), inserted as they are: a run of many ranks holds
        millions of rows, never made into objects."""
        self._flush_timeline()  # rows added as objects before these go first
        for table, cls in (("timeline", TimelineRow), ("timeline_formats", TimelineShare),
                           ("step_scalars", StepScalar)):
            t = tables.get(table)
            if t is None or not t.num_rows:
                continue
            self._insert(table, [n for n, _ in dataclass_columns(cls)], t)

    def _flush_timeline(self) -> None:
        import pyarrow as pa

        kinds = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
        for table, cls in (("timeline", TimelineRow), ("timeline_formats", TimelineShare),
                           ("step_scalars", StepScalar)):
            items = self._timeline[table]
            if not items:
                continue
            cols = dataclass_columns(cls)
            self._insert(table, [n for n, _ in cols],
                         pa.table({n: pa.array([getattr(x, n) for x in items], type=kinds[k]) for n, k in cols}))
            items.clear()

    def add_comparison(self, *, kind: str, ref_run_id: str, ref_rid: Optional[int], cand_run_id: str,
                       cand_rid: Optional[int], step: int, rank: int, seq: int, op: str, role: str,
                       index: str, match: str, comparison) -> None:
        cols = [n for n, _ in comparison_columns()]
        vals = [self.session_id, kind, ref_run_id, ref_rid, cand_run_id, cand_rid, step, rank, seq, op, role,
                index, match]
        if comparison is None:
            vals += [None] * (len(cols) - len(vals))
        else:
            vals += [getattr(comparison, f.name) for f in dataclasses.fields(comparison)]
        self._cmps.append(vals)
        if len(self._cmps) >= self.BATCH:
            self.flush()

    def set_run_dtype(self, run_id: str, dtype: str) -> None:
        """Record a run's compute dtype once its records have been read."""
        self.cur.execute("UPDATE runs SET dtype = ? WHERE run_id = ?", [dtype, run_id])

    def set_run_lineage(self, run_id: str, *, parent_run_id: Optional[str], fix: Optional[str],
                        kind: Optional[str]) -> None:
        """Record the run a re-run was made from, the fix that made it and (when given) its kind."""
        self.cur.execute("UPDATE runs SET parent_run_id = ?, fix = ?, kind = coalesce(?, kind) WHERE run_id = ?",
                         [parent_run_id, fix, kind, run_id])

    def set_run_order(self, run_id: str, order: str, seqs: dict[int, int]) -> None:
        """Renumber a run's records (``seqs``: rid -> new seq) and say where its order came from."""
        import pyarrow as pa

        self.flush()
        if seqs:
            table = pa.table({"rid": list(seqs), "seq": list(seqs.values())})
            self.cur.register("_pl_seq", table)
            self.cur.execute("UPDATE tensors SET seq = s.seq FROM _pl_seq s WHERE tensors.run_id = ? "
                             "AND tensors.rid = s.rid", [run_id])
            self.cur.unregister("_pl_seq")
        self.cur.execute("UPDATE runs SET \"order\" = ? WHERE run_id = ?", [order, run_id])

    def set_op_parents(self, run_id: str, parents: dict[str, str]) -> None:
        """Record the module call each op ran inside (``parents``: op -> enclosing op) where the dump did not."""
        import pyarrow as pa

        self.flush()
        table = pa.table({"op": list(parents), "parent": list(parents.values())})
        self.cur.register("_pl_parent", table)
        self.cur.execute("UPDATE tensors SET parent = p.parent FROM _pl_parent p WHERE tensors.run_id = ? "
                         "AND tensors.op = p.op AND tensors.parent IS NULL", [run_id])
        self.cur.unregister("_pl_parent")

    def set_run_parent(self, run_id: str, parent_run_id: str) -> None:
        """Record the run a re-run was made from."""
        self.cur.execute("UPDATE runs SET parent_run_id = ? WHERE run_id = ?", [parent_run_id, run_id])

    def clear_diagnoses(self) -> None:
        """Drop the session's diagnoses (they are recomputed as a whole)."""
        self.cur.execute("DELETE FROM diagnoses WHERE session_id = ?", [self.session_id])

    def add_diagnosis(self, d: Diagnosis) -> None:
        d = dataclasses.replace(d, session_id=self.session_id)
        cols = [f.name for f in dataclasses.fields(Diagnosis)]
        vals = [d.fixes_json() if c == "fixes" else getattr(d, c) for c in cols]
        self.cur.execute(f"INSERT INTO diagnoses ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", vals)

    def worsen_verdicts(self, run_id: str, op: str, step: int, rank: int, verdict: str, reason: str) -> None:
        """Judge the output comparisons of one op call of ``run_id`` ``verdict`` (with ``reason``) where they
        were judged better or not at all (no reference record to compare with): a finding made from more than
        the comparison (a quantise op judged against its own input)."""
        better = [v.value for v in Verdict if v.rank < Verdict(verdict).rank]
        self.cur.execute(f"""UPDATE comparisons SET verdict = ?, reason = ? WHERE session_id = ? AND cand_run_id = ?
                             AND op = ? AND step = ? AND rank = ? AND role = 'output'
                             AND (verdict IS NULL OR verdict IN ({', '.join('?' * len(better))}))""",
                         [verdict, reason, self.session_id, run_id, op, int(step), int(rank), *better])

    def add_warning(self, file: str, message: str, run_id: Optional[str] = None) -> None:
        self._warns.append((self.session_id, run_id, str(file), str(message)))
        if len(self._warns) >= self.BATCH:
            self.flush()

    def set_notes(self, notes: dict) -> None:
        self.cur.execute("UPDATE sessions SET notes = ? WHERE session_id = ?", [json.dumps(notes), self.session_id])

    def _notes(self) -> dict:
        row = self.cur.execute("SELECT notes FROM sessions WHERE session_id = ?", [self.session_id]).fetchone()
        try:
            notes = json.loads(row[0] or "{}") if row else {}
        except ValueError:
            notes = {}
        return notes if isinstance(notes, dict) else {}

    def _undiagnosed(self) -> None:
        """A new run takes the session's ``diagnosed`` mark away until its diagnoses are computed again."""
        notes = self._notes()
        if notes.pop("diagnosed", None) is not None:
            self.set_notes(notes)

    def mark_diagnosed(self) -> None:
        """Note in the session's notes (``diagnosed``: when) that its diagnoses were computed, in this
        transaction: a session without the mark was cut off between its write and its diagnosis."""
        notes = self._notes()
        notes["diagnosed"] = now_text()
        self.set_notes(notes)
