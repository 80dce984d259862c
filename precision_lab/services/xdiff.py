"""The first pair of two implementations that diverges beyond what the number format explains.

Given two runs paired by their data (``services.xpair``), each pair is
judged against the error its formats explain:

    expected = SAFETY * (kappa * (input_error + q) + (2 + sqrt(n)) * u_acc + u)

``u_acc`` is the unit roundoff (eps / 2) of the coarser of the two
tensors' dtypes (what the op rounded to and accumulated in), ``u`` that of
the coarsest format the computation went through (a declared format such as
fp8 held in fp32 tensors, else ``u_acc``), ``q`` = ``u / sqrt(3)`` where a declared
format is coarser than the dtypes (the op's inputs were rounded to it inside
the op: the RMS of a rounding error spread evenly over +-u is u / sqrt(3)), else 0; ``n`` the op's accumulation length (the inner dimension of a
matmul, the reduced length of a mean or a norm), ``input_error`` the largest
norm-wise relative error among the pair's inputs (each reference input
against the candidate input closest to it), and ``kappa`` the op's
conditioning measured on the reference's own inputs (``|x| |W|`` against
``x W`` for a matmul, ``|a| + |b|`` against ``a + b`` for an add, the
largest logit for softmax and exp, ``x f'(x)`` against ``f(x)`` for cos and sin; a call whose function is not known, a
module or a fused region, gets the ratio of its inputs' size to its
output's, times ``OPAQUE``; its ``u_acc`` is that of the coarsest format of
16 bits or more its calls computed in, as bf16 inside an fp32 block under
autocast).  With a benign second run (one that differs
only in reduction order, or in the attention kernel), the band is also at
least ``BENIGN_FACTOR`` times the error that run shows at the same op.

A pair **diverges** when its output's relative error exceeds ``expected``
(or it holds a non-finite value its reference does not) while its inputs
agree (input error at most ``AGREE``: beyond it the output's error is no
longer predicted from the inputs'; where no input could be compared, only an
op of integer inputs alone agrees -- a module call's parameters are not
among its recorded inputs).  The answer is the first diverging pair
in the reference's execution order.  Each pair also carries the metrics of
``metrics.compare`` side by side (SQNR, max abs, max relative, cosine): one
of them alone can hide a blow-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..formats import FORMATS, Format, format_for_dtype, get_format
from ..metrics import Comparison, compare, compare_stats
from ..ops import canonical
from ..records import TensorRecord, npy_load
from ..store import SessionNotFound
from ..store.queries import run_records_with_data, session_runs
from .xcalls import OpPair, Pairing, aligned, op_calls, rel_error, values_of
from .xpair import pair_runs

__all__ = ["PairJudgment", "DiffResult", "DiffRow", "diff_records", "judge", "inner_roundoff", "run_records", "resolve_run", "DiffInputError",
           "diff_rows", "render_diff_text", "SAFETY", "AGREE", "OPAQUE", "BENIGN_FACTOR"]

SAFETY = 4.0
AGREE = 0.1
OPAQUE = 2.0
BENIGN_FACTOR = 8.0

_MATMUL = {"linear", "matmul", "addmm", "einsum", "baddbmm", "conv1d", "conv2d", "conv3d"}
_EXPLIKE = {"softmax", "exp", "log_softmax", "silu", "gelu", "sigmoid", "tanh", "softplus", "elu"}
_REDUCE = {"mean", "sum", "var", "std", "norm", "cumsum"}
_NORMS = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"}


@dataclass(frozen=True)
class PairJudgment:
    """One pair, judged.  Errors are norm-wise relative errors (``|c - r| / |r|``); ``basis``: ``"tensor"``
    (element-wise) or ``"stats"`` (summary statistics only)."""

    pair: OpPair
    basis: str
    out_error: Optional[float]
    in_error: Optional[float]
    inputs_compared: int
    kappa: float
    accumulation: int
    unit_roundoff: float
    expected: float
    inputs_agree: bool
    diverges: bool
    comparison: Optional[Comparison]

    @property
    def ratio(self) -> Optional[float]:
        """Output error over the band (above 1: beyond what the format explains)."""
        if self.out_error is None or self.expected <= 0:
            return None
        return self.out_error / self.expected


@dataclass(frozen=True)
class DiffResult:
    pairing: Pairing
    judgments: tuple[PairJudgment, ...]
    first: Optional[PairJudgment]
    ref_format: Optional[str]
    cand_format: Optional[str]

    @property
    def diverged(self) -> bool:
        return self.first is not None


def _rms(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.sqrt(np.mean(a * a))) if a.size else 0.0


def _format_of(rec: TensorRecord, declared: Optional[Format]) -> Format:
    own = format_for_dtype(rec.stats.dtype)
    if declared is not None and (own is None or own.kind != "float" or declared.eps > own.eps):
        return declared
    return own if own is not None and own.kind == "float" else FORMATS["fp32"]


def _float_inputs(recs: Sequence[TensorRecord]) -> list[TensorRecord]:
    out = []
    for r in recs:
        f = format_for_dtype(r.stats.dtype)
        if (f is not None and f.kind == "float") or "float64" in str(r.stats.dtype):
            out.append(r)
    return out


def _input_error(ref_in: Sequence[TensorRecord], cand_in: Sequence[TensorRecord]) -> tuple[Optional[float], int]:
    """(largest relative error of a reference input against its closest candidate input, inputs compared)."""
    worst, n = None, 0
    cand = [(c, values_of(c)) for c in _float_inputs(cand_in)]
    for r in _float_inputs(ref_in):
        rv = values_of(r)
        best = None
        for c, cv in cand:
            if c.stats.numel != r.stats.numel:
                continue
            if rv is not None and cv is not None:
                e = _layout_error(rv, cv)
            else:
                e = _stats_error(r, c)
            if e is not None and (best is None or e < best):
                best = e
        if best is not None:
            n += 1
            worst = best if worst is None else max(worst, best)
    return worst, n


def _layout_error(rv: np.ndarray, cv: np.ndarray) -> Optional[float]:
    """Relative error of an input against the reference's, up to layout: as ``aligned`` lays it out, or with its
    last two axes swapped where they are of one length (a matmul reads k transposed, a ``Conv1D`` stores its
    weight (in, out)); None when their sizes differ."""
    al = aligned(rv, cv)
    if al is None:
        return None
    e = rel_error(rv, al)
    if e > 0 and al.ndim >= 2 and al.shape[-1] == al.shape[-2]:
        e = min(e, rel_error(rv, np.swapaxes(al, -1, -2)))
    return e


def _stats_error(r: TensorRecord, c: TensorRecord) -> Optional[float]:
    a, b = r.stats.l2norm, c.stats.l2norm
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(b - a) / a if a > 0 else (0.0 if b == 0 else math.inf)


def _conditioning(pair: OpPair, call, opaque: bool) -> tuple[float, int]:
    """(kappa, accumulation length) of ``call``'s computation, measured on the reference's inputs; ``opaque``:
    judged as a computation whose function is not known (a module, a fused region)."""
    kind = "opaque" if opaque else (canonical(call.op_type) or call.op_type.lower())
    ins = [values_of(r) for r in _float_inputs(call.inputs)]
    ins = [v for v in ins if v is not None]
    out = pair.ref_value
    last = max([int(r.stats.shape[-1]) for r in call.inputs if r.stats.shape] + [1])
    if out is None or not ins:
        return OPAQUE, last
    ro = _rms(out)
    if ro == 0:
        return OPAQUE, last
    try:
        if kind in ("linear", "matmul") and len(ins) >= 2:
            x, w = ins[0], ins[1]
            ab = np.abs(x) @ (np.abs(w).T if kind == "linear" else np.abs(w))
            return max(1.0, _rms(ab) / ro), int(x.shape[-1])
        if kind == "addmm" and len(ins) >= 3:
            b, x, w = ins[0], ins[1], ins[2]
            return max(1.0, _rms(np.abs(b) + np.abs(x) @ np.abs(w)) / ro), int(x.shape[-1])
    except ValueError:  # shapes not of a plain matmul: judged as an opaque call
        pass
    big = max(float(np.max(np.abs(v[np.isfinite(v)]))) if np.isfinite(v).any() else 0.0 for v in ins)
    if kind in ("cos", "sin"):  # |x f'(x)| against |f(x)|: large where the value crosses zero
        x = ins[0]
        slope = np.sin(x) if kind == "cos" else np.cos(x)
        return max(1.0, _rms(x * slope) / ro), 1
    if kind in _EXPLIKE:
        return max(1.0, 2.0 * big), last if kind in ("softmax", "log_softmax") else 1
    if kind == "scaled_dot_product_attention" and len(ins) >= 2:
        d = ins[0].shape[-1]
        return 2.0 + 3.0 * _rms(ins[0]) * _rms(ins[1]) * math.sqrt(d), int(ins[1].shape[-2]) + d
    if kind in ("add", "sub"):
        return max(1.0, sum(_rms(v) for v in ins) / ro), 1
    if kind in ("mul", "div", "pow", "rsqrt", "sqrt", "reciprocal", "to", "float", "neg", "cat", "relu", "dropout"):
        return float(max(1, len(ins))) * (2.0 if kind == "pow" else 1.0), 1
    if kind in _REDUCE:
        x = ins[0]
        n = max(1, x.size // max(1, out.size))
        return max(1.0, float(np.mean(np.abs(x))) / max(float(np.mean(np.abs(out))), 1e-300)), n
    if kind in _NORMS:
        x = ins[0]
        centred = _rms(x - np.mean(x, axis=-1, keepdims=True)) if kind != "rms_norm" else _rms(x)
        return 2.0 * max(1.0, _rms(x) / max(centred, 1e-300)), last
    return OPAQUE * max(1.0, sum(_rms(v) for v in ins) / ro), last


def _levels(pair: OpPair) -> list[tuple]:
    """(reference call, candidate call, opaque) whose inputs a pair is judged from: the innermost calls, and each
    module boundary around them on either side (a module call, a fused region)."""
    fused = pair.how == "fused N:1"
    refs = [pair.ref[0]] + [c for c in pair.ref[1:] if c.is_module_call]
    cands = [pair.cand[0]] + [c for c in pair.cand[1:] if c.is_module_call]
    return [(r, c, fused or r is not pair.ref[0] or c is not pair.cand[0]) for r in refs[:4] for c in cands[:4]]


def _region_inputs(pair: OpPair, ref_call, cand_call) -> tuple[tuple, tuple]:
    """The inputs a view of a pair is judged from: a call's own; at the innermost calls of a fused region, those
    of every call of each side's region (a written-out attention reads q and k in one matmul, v in the next)."""
    if pair.how != "fused N:1" or ref_call is not pair.ref[0] or cand_call is not pair.cand[0]:
        return ref_call.inputs, cand_call.inputs
    return (tuple(r for c in pair.ref if not c.is_module_call for r in c.inputs),
            tuple(r for c in pair.cand if not c.is_module_call for r in c.inputs))


def _compute_roundoff(call) -> float:
    """The unit roundoff of a call's output format where ops compute in it (16 bits or more); a cast to an 8-bit
    format is a quantisation of inputs, which a declared format accounts for (``q``), not a format that is
    accumulated in."""
    f = _format_of(call.out, None)
    return f.eps / 2 if f.bits >= 16 else 0.0


def inner_roundoff(records: Sequence[TensorRecord]) -> dict[tuple, float]:
    """(step, rank, module path) -> the coarsest unit roundoff among the outputs of the calls made in that module
    or below it, of the formats ops compute in (a block whose boundary is fp32 while it computed in bf16 under
    autocast)."""
    out: dict[tuple, float] = {}
    for c in op_calls(records)[0]:
        u = _compute_roundoff(c)
        parts = c.module.split(".") if c.module else []
        for k in range(len(parts) + 1):
            key = (c.step, c.rank, ".".join(parts[:k]))
            if u > out.get(key, 0.0):
                out[key] = u
    return out


def _view_roundoff(pair: OpPair, ref_call, cand_call, inner: Optional[tuple[dict, dict]]) -> float:
    """The coarsest unit roundoff inside an opaque view: of every call of a fused region, of the calls inside a
    module call."""
    u = max(_compute_roundoff(c) for c in pair.ref + pair.cand) if pair.how == "fused N:1" else 0.0
    for call, table in zip((ref_call, cand_call), inner or ()):
        if call.is_module_call:
            u = max(u, table.get((call.step, call.rank, call.module), 0.0))
    return u


def judge(pair: OpPair, *, ref_format: Optional[str] = None, cand_format: Optional[str] = None,
          benign: Optional[float] = None, safety: float = SAFETY,
          inner: Optional[tuple[dict, dict]] = None) -> PairJudgment:
    """One pair against the band its formats explain (see the module doc).  A pair is judged at its innermost
    calls and at the boundary around them: it diverges when at either its inputs agree and its output's error is
    beyond the band there.  ``inner``: ``inner_roundoff`` of each run, for the formats used inside a module
    call."""
    rf = _format_of(pair.ref[-1].out, None)
    cf = _format_of(pair.cand[-1].out, None)
    u_acc = max(rf.eps, cf.eps) / 2  # what the tensors' own dtypes round to, and accumulate in
    declared = [get_format(f) for f in (ref_format, cand_format) if f]
    u = max([u_acc] + [f.eps / 2 for f in declared])  # the coarsest format the computation went through
    # inputs rounded to a declared format inside the op (fake quantisation): the RMS of a relative rounding error
    # spread evenly over +-u is u / sqrt(3)
    q = u / math.sqrt(3.0) if u > u_acc else 0.0
    if cand_format:
        cf = get_format(cand_format)
    cmp = None
    if pair.ref_value is not None and pair.cand_value is not None:
        c = aligned(pair.ref_value, pair.cand_value)
        basis = "tensor"
        out_err = rel_error(pair.ref_value, c) if c is not None else None
        if c is not None:
            cmp = compare(pair.ref_value, c, cand_format=cf.name)
    else:
        basis = "stats"
        out_err = _stats_error(pair.ref[-1].out, pair.cand[-1].out)
        cmp = compare_stats(pair.ref[-1].out.stats, pair.cand[-1].out.stats, cand_format=cf.name)
    nonfinite = bool(cmp is not None and cmp.nonfinite_introduced)
    views = []
    for ref_call, cand_call, opaque in _levels(pair):
        in_err, n_in = _input_error(*_region_inputs(pair, ref_call, cand_call))
        kappa, n = _conditioning(pair, ref_call, opaque)
        u_view = max(u_acc, _view_roundoff(pair, ref_call, cand_call, inner)) if opaque else u_acc
        expected = safety * (kappa * ((in_err or 0.0) + q) + (2.0 + math.sqrt(n)) * u_view + max(u, u_view))
        if benign is not None and math.isfinite(benign):
            expected = max(expected, BENIGN_FACTOR * benign)
        if in_err is None:
            # nothing to compare: agreement is known only for an op of integer inputs alone (a module call's
            # parameters are not among its inputs)
            agree = not (_float_inputs(ref_call.inputs) or _float_inputs(cand_call.inputs)
                         or ref_call.is_module_call or cand_call.is_module_call)
        else:
            agree = in_err <= AGREE
        bad = nonfinite or (out_err is not None and (out_err > expected or math.isnan(out_err)))
        views.append((bool(bad and agree), -expected, in_err, n_in, kappa, n, expected, agree))
    # the deciding view: a diverging one, else the widest band
    div, _, in_err, n_in, kappa, n, expected, agree = max(views, key=lambda v: (v[0], v[1]))
    return PairJudgment(pair=pair, basis=basis, out_error=out_err, in_error=in_err, inputs_compared=n_in,
                        kappa=kappa, accumulation=n, unit_roundoff=u, expected=expected, inputs_agree=agree,
                        diverges=div, comparison=cmp)


def diff_records(ref: Sequence[TensorRecord], cand: Sequence[TensorRecord], *, ref_format: Optional[str] = None,
                 cand_format: Optional[str] = None, benign: Optional[Sequence[TensorRecord]] = None,
                 safety: float = SAFETY) -> DiffResult:
    """Pair two runs by their data and judge every pair; ``first`` is the first pair that diverges.

    ``ref_format``/``cand_format``: the formats each run computed in where their tensors' dtypes do not say it
    (fp8 fake-quantised values held in fp32); ``benign``: the records of a run that differs from ``ref`` only
    in what should not matter (reduction order), whose error widens each op's band.
    """
    pairing = pair_runs(ref, cand)
    bands: dict[str, float] = {}
    if benign is not None:
        for j in diff_records(ref, benign, ref_format=ref_format, safety=safety).judgments:
            if j.out_error is not None:
                for c in j.pair.ref:
                    bands[c.op] = max(bands.get(c.op, 0.0), j.out_error)
    inner = (inner_roundoff(ref), inner_roundoff(cand))
    judgments = tuple(judge(p, ref_format=ref_format, cand_format=cand_format, safety=safety, inner=inner,
                            benign=max((bands[c.op] for c in p.ref if c.op in bands), default=None))
                      for p in pairing.pairs)
    first = next((j for j in judgments if j.diverges), None)
    return DiffResult(pairing, judgments, first, ref_format, cand_format)


# ---- where the two runs come from -----------------------------------------------------------------

class DiffInputError(ValueError):
    """A ``diff`` input that cannot be used: the sentence says which and why."""


def run_records(store, run_id: str) -> list[TensorRecord]:
    """A stored run's records, each with its kept tensor (``tensor``: numpy) where one was kept."""
    out = []
    for row in run_records_with_data(store, run_id):
        out.append(TensorRecord(run_id=run_id, seq=row.seq, op=row.op, op_type=row.op_type or "", role=row.role,
                                index=row.index, stats=row.stats, step=row.step, rank=row.rank,
                                direction=row.direction or "forward", parent=row.parent,
                                tensor=npy_load(row.npy) if row.npy is not None else None))
    return out


def resolve_run(store, spec: str, shown: Optional[str] = None) -> tuple[str, str]:
    """``(run_id, label)`` of ``SESSION`` (a session with one run) or ``SESSION:RUN`` (a run by name or id);
    ``shown``: what the user gave for the session (a dump's path), for messages."""
    session, _, run = spec.partition(":")
    try:
        info = store.session(session)
    except SessionNotFound as e:
        raise DiffInputError(f"{spec}: {e.args[0]}") from None
    runs = session_runs(store, info.session_id)
    if run:
        hit = [r for r in runs if run in (r.name, r.run_id)]
        if not hit:
            raise DiffInputError(f"{spec}: session {info.name!r} has no run {run!r} (its runs: "
                                 f"{', '.join(r.name for r in runs)})")
        return hit[0].run_id, f"{info.name}:{hit[0].name}"
    if len(runs) != 1:
        where = shown or info.name
        raise DiffInputError(f"{where}: {len(runs)} runs ({', '.join(r.name for r in runs)}); name one as "
                             f"{where}:RUN")
    return runs[0].run_id, f"{info.name}:{runs[0].name}"


# ---- text --------------------------------------------------------------------------------------------

def _num(v: Optional[float], fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


@dataclass(frozen=True, slots=True)
class DiffRow:
    """One pair of a diff: the first op of each side and how many calls it stands for, how it was paired and how
    sure, the basis of its comparison, the output error beside the input error and the band the formats explain
    (``expected``), the metrics of the comparison (None without one), and whether it diverges."""

    ref: str
    ref_calls: int
    cand: str
    cand_calls: int
    how: str
    confidence: float
    basis: Optional[str]
    out_error: Optional[float]
    in_error: Optional[float]
    expected: Optional[float]
    sqnr_db: Optional[float]
    max_abs_err: Optional[float]
    max_rel_err: Optional[float]
    cosine: Optional[float]
    diverges: bool

    @property
    def ref_text(self) -> str:
        """The reference side as the tables write it: its op, and how many calls more it stands for."""
        return self.ref + (f" (+{self.ref_calls - 1})" if self.ref_calls > 1 else "")

    @property
    def cand_text(self) -> str:
        return self.cand + (f" (+{self.cand_calls - 1})" if self.cand_calls > 1 else "")


def diff_rows(result: DiffResult) -> list[DiffRow]:
    """One row per pair in the reference's execution order: the pairing and the metrics side by side."""
    out = []
    for j in result.judgments:
        c = j.comparison
        out.append(DiffRow(j.pair.ref[0].op, len(j.pair.ref), j.pair.cand[0].op, len(j.pair.cand), j.pair.how,
                           j.pair.confidence, j.basis, j.out_error, j.in_error, j.expected,
                           c.sqnr_db if c else None, c.max_abs_err if c else None, c.max_rel_err if c else None,
                           c.cosine if c else None, j.diverges))
    return out


def render_diff_text(result: DiffResult, ref_label: str, cand_label: str, *, limit: int = 40) -> str:
    """The first divergent pair in a sentence, the pairing's counts, and the pairs around it as a table."""
    p = result.pairing
    hows = ", ".join(f"{p.count(h)} by {h}" for h in ("name", "anchor", "data-flow", "fused N:1") if p.count(h))
    lines = [f"reference {ref_label} vs candidate {cand_label}",
             f"{len(p.pairs)} pairs ({hows or 'none'}); unpaired: {len(p.unpaired_ref)} reference, "
             f"{len(p.unpaired_cand)} candidate call(s)"]
    f = result.first
    if f is None:
        lines.append("no pair diverges beyond what the formats explain")
        start = 0
    else:
        lines.append(f"first divergent pair: {f.pair.label} ({f.pair.how}, confidence {f.pair.confidence:.2f}): "
                     f"output error {_num(f.out_error)} against {_num(f.expected)} expected from inputs that "
                     f"agree to {_num(f.in_error)} (u = {f.unit_roundoff:.3g}, kappa {f.kappa:.3g}, "
                     f"n = {f.accumulation})")
        start = max(0, result.judgments.index(f) - limit // 4)
    lines.append("")
    lines.append(f"{'':2}{'reference':48} {'candidate':40} {'how':10} {'conf':>5} {'out err':>9} {'in err':>9} "
                 f"{'band':>9} {'SQNR dB':>8} {'max abs':>9} {'max rel':>9} {'cosine':>10}")
    for r in diff_rows(result)[start:start + limit]:
        mark = "!!" if r.diverges else "  "
        ref, cand = r.ref_text, r.cand_text
        lines.append(f"{mark}{ref[-48:]:48} {cand[-40:]:40} {r.how:10} {r.confidence:5.2f} "
                     f"{_num(r.out_error):>9} {_num(r.in_error):>9} {_num(r.expected):>9} "
                     f"{_num(r.sqnr_db, '.1f'):>8} {_num(r.max_abs_err):>9} {_num(r.max_rel_err):>9} "
                     f"{_num(r.cosine, '.7f'):>10}")
    for side, calls in (("reference", p.unpaired_ref), ("candidate", p.unpaired_cand)):
        if calls:
            names = ", ".join(c.op for c in calls[:12]) + (f" and {len(calls) - 12} more" if len(calls) > 12 else "")
            lines.append(f"unpaired {side} calls: {names}")
    return "\n".join(lines)
