"""A long run's timeline: a cheap summary of every step, full records every N-th step,
and the last K steps' full records kept when a step goes non-finite (the frames that led to it).

The summary covers each module's output and each parameter's gradient:
statistics without a histogram and, in the same pass, the magnitudes at or
above each watched format's overflow, underflow and normal thresholds
(``stats.summary_stats``), which give its overflow, underflow and subnormal
counts exactly.  CUDA tensors take the histogram on the device, where it is
cheap, and reach the host with the step's one transfer.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque

import numpy as np
from typing import Optional

from ..alerts import RULES_BY_NAME, grad_spike_alerts, loss_scale_alerts, op_alerts, op_format
from ..formats import get_format
from ..ops import MASKING_OPS, canonical
from ..records import StepScalar, TimelineRow, TimelineShare, tensor_name
from ..stats import format_counts, format_counts_above, format_edges
from .engine import StatsEngine

__all__ = ["Timeline", "unexpected_nonfinite", "NONFINITE_SCALAR", "SKIPPED_SCALAR"]

# the step scalar that counts a step's unexpected non-finite values (the timeline's failure marker)
NONFINITE_SCALAR = "nonfinite_values"
# the step scalar that marks a step the job's GradScaler skipped (inf/NaN in its scaled gradients)
SKIPPED_SCALAR = "scaler_skipped"


def unexpected_nonfinite(op_type: str, nan: Optional[int], inf: Optional[int], neg_inf: Optional[int]) -> int:
    """How many of a summary's non-finite values are a failure: NaN, +inf, and -inf unless a masking op
    (``ops.MASKING_OPS``) wrote it."""
    nan, inf = int(nan or 0), int(inf or 0)
    if neg_inf is None:
        return nan + inf
    neg = int(neg_inf)
    masked = canonical(op_type) in MASKING_OPS
    return nan + (inf - neg) + (0 if masked else neg)


def _crosses(stats, fmt) -> bool:
    """Whether ``stats``' extremes reach a value ``fmt`` overflows or cannot hold as a normal number."""
    a, m = stats.absmax, stats.min_abs_nonzero
    return (a is not None and a >= fmt.overflow_threshold) or (m is not None and m < fmt.normal_threshold)


class Timeline:
    """A capture's timeline: the step summaries, the step scalars, the frames kept before a non-finite step and
    the alerts fired live.

    ``engine`` is the capture's own statistics engine (a summary taken on a fully recorded step uses it);
    ``warn(where, message)`` and ``hook_error(where, exception)`` note a problem on the run.
    """

    def __init__(self, options, *, run: str, run_id: str, rank: int, engine: StatsEngine, warn, hook_error):
        self.options = options
        self.run, self.run_id, self.rank = run, run_id, rank
        self._engine = engine
        self._hook_error = hook_error
        self._lock = threading.Lock()
        self.rows: list[TimelineRow] = []
        self.shares: list[TimelineShare] = []
        self.scalars: list[StepScalar] = []
        self.frames: list[int] = []  # steps kept only because a later step went non-finite
        self.first_nonfinite_step: Optional[int] = None
        self.alerts: list = []  # alerts fired live (``on_alert``)
        self._warn = warn
        self._items: list = []
        self._tid = 0
        self._ring: Optional[deque] = deque(maxlen=options.keep_last) if options.keep_last else None
        self._watch = [get_format(w) for w in options.watch]
        self._live: dict = {}  # (op, role, index) -> the last points of its series, for the live rules
        self._fired: set = set()
        self._norms: deque = deque()  # (step, global gradient norm) of the last steps, for the spike rule
        self._peak: Optional[tuple] = None  # (step, scale): the loss scale's largest so far
        self._summary_engine = None
        if options.timeline:
            # CPU tensors: the watched formats' thresholds counted in the scan, no histogram; device tensors:
            # the histogram, on the device
            edges = {i for f in self._watch for i in format_edges(f) if i is not None}
            self._summary_engine = StatsEngine(options, warn=warn, histogram=False, device_histogram=True,
                                               above_edges=edges)

    # ---- during a step ----------------------------------------------------------------------
    def summarise(self, seq, op, op_type, role, index, direction, t, location, *, full: bool) -> None:
        """Note one tensor of the step's timeline (a module output or a parameter gradient); ``full``: the step
        is recorded in full, and the tensor's statistics come from the capture's engine."""
        hold = direction == "backward"
        if full:
            h = self._engine.measure(t, op, hold=hold)
        else:
            h = self._summary_engine.measure(t, op, hold=hold)
        if h is not None:
            with self._lock:
                self._items.append((seq, op, op_type, role, str(index), direction, location, h))

    def add_scalars(self, step: int, loss, grad_scaler, *, scale: Optional[float] = None) -> None:
        """The step's loss and loss scale: ``scale`` where the capture knows the one the step used, else the
        ``grad_scaler``'s now."""
        if loss is not None:
            try:
                v = float(loss.detach().float().item()) if hasattr(loss, "detach") else float(loss)
            except Exception as e:
                self._warn("timeline", f"loss of step {step} is not a number ({e})")
            else:
                self.scalars.append(StepScalar(self.run_id, step, self.rank, "loss", v))
        if scale is not None:
            self.scalars.append(StepScalar(self.run_id, step, self.rank, "loss_scale", float(scale)))
        elif grad_scaler is not None:
            try:
                if grad_scaler.is_enabled():
                    self.scalars.append(StepScalar(self.run_id, step, self.rank, "loss_scale",
                                                   float(grad_scaler.get_scale())))
            except Exception as e:
                self._warn("timeline", f"could not read the GradScaler's scale ({e})")

    def new_step(self) -> None:
        if self._summary_engine is not None:
            self._summary_engine.new_step()

    # ---- the end of a step --------------------------------------------------------------------
    def pending(self, step: int) -> bool:
        """Whether step ``step`` has summaries or scalars (a loss, a loss scale) waiting for its end."""
        return bool(self._items) or (bool(self.scalars) and self.scalars[-1].step == step)

    def resolve(self) -> None:
        if self._summary_engine is not None:
            self._summary_engine.resolve()

    def end_step(self, step: int, step_records: list, local: list, *, scaler_skipped: bool = False) -> list:
        """Make the step's timeline rows and decide which full records stay: ``[(step, records, local)]`` to
        keep now, ``local`` being the group's local comparisons by position in it (``local`` given: this
        step's).  ``scaler_skipped``: the job's GradScaler skipped the step, so its gradients' inf/NaN are the
        scaler's overflow check at work, not a failure (its ``scaler_skipped`` scalar says so)."""
        first_row, first_share = len(self.rows), len(self.shares)
        items, self._items = self._items, []
        bad = self._summarise_step(step, items, scaler_skipped)
        if self.options.on_alert is not None:
            self._live_alerts(step, self.rows[first_row:], self.shares[first_share:])
        loss = next((x.value for x in self.scalars if x.step == step and x.name == "loss"), None)
        if items or loss is not None:
            if loss is not None and not math.isfinite(loss):
                bad += 1
            self.scalars.append(StepScalar(self.run_id, step, self.rank, NONFINITE_SCALAR, float(bad)))
        if scaler_skipped:
            self.scalars.append(StepScalar(self.run_id, step, self.rank, SKIPPED_SCALAR, 1.0))
        return self._kept_groups(step, step_records, local, bad)

    def _summarise_step(self, step: int, items: list, scaler_skipped: bool) -> int:
        """The step's timeline rows and watched-format shares from its summaries; returns how many of their
        values are an unexpected NaN/Inf (none of the gradients of a step the GradScaler skipped)."""
        bad = 0
        with_hist = []  # (tid, finite, hist) whose watched-format counts come from the histogram, all at once below
        for seq, op, op_type, role, index, direction, location, h in items:
            s = h.stats
            if s is None:
                continue
            tid = self._tid
            self._tid += 1
            self.rows.append(TimelineRow(
                run_id=self.run_id, tid=tid, step=step, rank=self.rank, seq=seq, op=op, op_type=op_type, role=role,
                index=index, direction=direction, dtype=s.dtype, numel=s.numel, nan_count=s.nan_count,
                inf_count=s.inf_count, neg_inf_count=s.neg_inf_count, zero_count=s.zero_count, absmax=s.absmax,
                min_abs_nonzero=s.min_abs_nonzero, l2norm=s.l2norm, location=location))
            finite = s.numel - int(s.nan_count or 0) - int(s.inf_count or 0)
            if s.hist is not None:
                with_hist.append((tid, finite, s.hist))
            elif h.above is not None:
                nonzero = finite - int(s.zero_count or 0)
                for fmt in self._watch:
                    self.shares.append(TimelineShare(self.run_id, tid, fmt.name, finite,
                                                     *format_counts_above(h.above, nonzero, fmt)))
            else:
                for fmt in self._watch:
                    if not _crosses(s, fmt):  # exactly none past either end; otherwise unknown, no row
                        self.shares.append(TimelineShare(self.run_id, tid, fmt.name, finite, 0, 0, 0))
            if not (scaler_skipped and direction == "backward"):
                bad += unexpected_nonfinite(op_type, s.nan_count, s.inf_count, s.neg_inf_count)
        if with_hist:
            hists = np.stack([x[2] for x in with_hist])
            for fmt in self._watch:
                counts = zip(*(c.tolist() for c in format_counts(hists, fmt)))
                self.shares.extend(TimelineShare(self.run_id, tid, fmt.name, finite, *c)
                                   for (tid, finite, _), c in zip(with_hist, counts))
        return bad

    def _kept_groups(self, step: int, step_records: list, local: list, bad: int) -> list:
        """The full records to keep now, ``[(step, records, local)]``: this step's when every N-th step is kept
        (or nothing rings), and the last K steps' at the first non-finite step (``bad``: its unexpected NaN/Inf
        values)."""
        keep = self.options.full_step(step)
        groups = []  # (step, records, local comparisons relative to the group)
        if self._ring is not None and step_records and not keep:
            self._ring.append((step, step_records, local))
        else:
            if step_records:
                groups.append((step, step_records, local))
            if self._ring is not None:  # kept already: it still counts as one of the last K steps
                self._ring.append((step, None, None))
        if bad and self.first_nonfinite_step is None:
            self.first_nonfinite_step = step
            if self._ring:
                for s_no, recs, kept_local in self._ring:
                    if recs is None:
                        continue
                    groups.append((s_no, recs, kept_local))
                    if s_no != step:
                        self.frames.append(s_no)
                self._ring.clear()
        return groups

    def _fire(self, key, al) -> None:
        self._fired.add(key)
        self.alerts.append(al)
        try:
            self.options.on_alert(al)
        except Exception as e:  # the user's callback never breaks the step
            self._hook_error("on_alert", e)

    def _live_step_alerts(self, step: int, rows: list) -> None:
        """The whole-step rules: a gradient-norm spike against the previous steps, a collapsing loss scale."""
        sq = [r.l2norm * r.l2norm for r in rows if r.role == "param_grad" and r.l2norm is not None]
        if sq:
            w = int(RULES_BY_NAME["grad_spike"].params["window"])
            self._norms.append((step, math.sqrt(sum(sq))))
            while len(self._norms) > w + 1:
                self._norms.popleft()
            if (None, "grad_spike") not in self._fired:
                got = grad_spike_alerts(self.run, [p[0] for p in self._norms], [p[1] for p in self._norms])
                if got and got[0].step == step:
                    self._fire((None, "grad_spike"), dataclasses.replace(got[0], steps_firing=1))
        scale = next((x.value for x in self.scalars if x.step == step and x.name == "loss_scale"), None)
        if scale is not None:
            if self._peak is None or scale > self._peak[1]:
                self._peak = (step, scale)
            if (None, "loss_scale") not in self._fired:
                got = loss_scale_alerts(self.run, [self._peak[0], step], [self._peak[1], scale])
                if got and got[0].step == step:
                    self._fire((None, "loss_scale"), dataclasses.replace(got[0], steps_firing=1))

    def _live_alerts(self, step: int, rows: list, shares: list) -> None:
        """Run the op rules on this step's rows over the last points of each series (the growth fit's window is
        the longest look back any of them takes), and the whole-step rules; call ``on_alert`` for each alert
        that fires first now."""
        self._live_step_alerts(step, rows)
        window = int(RULES_BY_NAME["growth"].params["window"])
        by_tid = {(x.tid, x.fmt): x for x in shares}
        for r in rows:
            fmt = op_format(r.dtype) if r.role in ("output", "param_grad") else None
            a = r.absmax
            if fmt is None or a is None or not math.isfinite(a) or a <= 0:
                continue  # the stored rules skip such a point too
            key = (r.op, r.role, r.index)
            pts = self._live.setdefault(key, deque(maxlen=window))
            sh = by_tid.get((r.tid, fmt.name))
            pts.append((step, a, (sh.underflow + sh.subnormal) / sh.finite if sh is not None and sh.finite
                        else math.nan))
            shown = r.op if (r.role, r.index) == ("output", "0") else tensor_name(r.op, r.role, r.index)
            for al in op_alerts(self.run, shown, [p[0] for p in pts], [p[1] for p in pts], fmt,
                                [p[2] for p in pts]):
                if al.step != step or (r.role == "param_grad" and al.rule != "underflow") \
                        or (key, al.rule) in self._fired:
                    continue
                self._fire((key, al.rule), dataclasses.replace(al, op=r.op, steps_firing=1))
