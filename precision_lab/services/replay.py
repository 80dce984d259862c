"""Replay one op of a stored dump session from its dumped inputs.

When a tensor-mode dump holds an op's inputs and the op type is known,
``replay_op(store, session, op, fixes=...)`` recomputes it with
``fixes.replay.replay`` (fp32, as the candidate ran, and under a fix) and
compares each with ``metrics.compare`` against the dumped output and the
fp32 replay.  Inputs come from tensors kept in the store (``ingest
--keep-tensors``) or, when the dump folder is still on disk, from its files
inside that folder, read by ``readers.tensorfile.load_source`` with every
check ingest made (sizes, CRC-32s, safe unpickling); a file that fails one,
or that no longer holds what was ingested, is a ``ReadError`` naming it.
Non-tensor arguments (LayerNorm's shape and epsilon, softmax's dim) are
read from msprobe's ``dump.json`` next to the tensors; where it is missing
the op's defaults are used and the result says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..fixes.catalogue import fix_label
from ..fixes.policy import PrecisionPolicy
from ..fixes.replay import REPLAY_OPS, ReplayError, ReplayOutputs, canonical_op, replay
from ..formats import FORMATS, format_for_dtype
from ..metrics import compare
from ..readers import ReadError
from ..readers.safeio import ReadLimits, contained, limits_in_force, read_json
from ..readers.tensorfile import SUFFIXES, load_source
from ..records import RunInfo
from ..stats import tensor_stats
from ..store import queries as q
from ..store.rows import NamedRecord, SessionRow
from .share import SHARED_SOURCE

__all__ = ["ReplayResult", "ReplayableOp", "replay_op", "replayable_ops", "REPRODUCE_ULPS"]

# A replay "reproduces" a dumped output within this many units in the last place: the same fp16 kernel
# on another CPU (other vector width, fused multiply-add) may round an accumulation differently.
REPRODUCE_ULPS = 2.0


def _torch():
    import torch  # deferred: listing sessions must not pay for importing torch

    return torch


def _is_tensor(x) -> bool:
    return isinstance(x, _torch().Tensor)


def _dump_root(run: RunInfo) -> Optional[Path]:
    """The run's dump folder when it is still on disk (an imported or uploaded session's is not)."""
    root = Path(run.source or "")
    if str(root) in ("", ".") or str(root).startswith(SHARED_SOURCE):
        return None  # an imported session's source names a folder of the machine that exported it
    return root if root.is_dir() else None


# ---- result ------------------------------------------------------------------------------

@dataclass
class ReplayResult:
    """What a replay found.  ``outputs`` maps ``dumped``/``fp32``/``candidate``/``fixed`` to tensors;
    ``comparisons`` maps ``"<a> vs <b>"`` to a ``metrics.Comparison``."""

    op: str
    op_type: str
    replay_as: str
    run_id: str
    cand_format: str
    fix: Optional[str]
    policy: str
    notes: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    comparisons: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict]:
        """One row per output, for a table: nonfinite count, absmax and error against the fp32 replay."""
        out = []
        for name, t in self.outputs.items():
            s = tensor_stats(t, histogram=False)
            c = self.comparisons.get(f"{name} vs fp32")
            out.append({
                "output": name, "dtype": s.dtype, "nan": s.nan_count, "inf": s.inf_count, "absmax": s.absmax,
                "sqnr_db_vs_fp32": c.sqnr_db if c else None, "max_rel_err_vs_fp32": c.max_rel_err if c else None,
                "verdict_vs_fp32": c.verdict if c else None,
            })
        return out

    @property
    def dump_ulps(self) -> Optional[float]:
        """How far the candidate replay is from the dumped output, in units in the last place of the
        candidate format: 0 when bit for bit equal (NaN where NaN), inf when shapes, dtypes or the
        places of NaN/inf differ; None without a dump."""
        a, b = self.outputs.get("candidate"), self.outputs.get("dumped")
        if a is None or b is None:
            return None
        torch = _torch()
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            return math.inf
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return 0.0
        if not bool(same[~(torch.isfinite(a) & torch.isfinite(b))].all()):
            return math.inf
        c = self.comparisons.get("candidate vs dumped")
        u = c.max_ulp_err if c is not None else None
        return math.inf if u is None or not math.isfinite(u) else float(u)

    @property
    def reproduces_dump(self) -> Optional[bool]:
        """Whether the candidate replay reproduces the dumped output: bit for bit, or within
        ``REPRODUCE_ULPS`` (the same kernel on another CPU may round a sum differently); None without a dump."""
        u = self.dump_ulps
        return None if u is None else u <= REPRODUCE_ULPS

    @property
    def dump_match(self) -> str:
        """``"bit-exact"``, ``"within N ulps"``, or ``""`` when the replay does not reproduce the dump."""
        u = self.dump_ulps
        if u is None or u > REPRODUCE_ULPS:
            return ""
        return "bit-exact" if u == 0 else f"within {math.ceil(u)} ulp{'s' if math.ceil(u) > 1 else ''}"

    @property
    def fixed_is_finite(self) -> bool:
        t = self.outputs.get("fixed")
        return t is not None and bool(_torch().isfinite(t).all())


# ---- loading the op's tensors --------------------------------------------------------------

def _as_dtype(t, dtype_name: Optional[str]):
    """A stored image back in the record's own dtype (the store keeps bf16/fp8 as float32)."""
    fmt = format_for_dtype(dtype_name) if dtype_name else None
    if fmt is not None and fmt.torch_dtype() is not None and t.dtype != fmt.torch_dtype():
        return t.to(fmt.torch_dtype())
    return t


def _load_tensor(store, run: RunInfo, rec: NamedRecord):
    """The record's tensor: kept in the store, else read from the dump folder (a tensor file or a shard)."""
    torch = _torch()
    arr = store.tensor(run.run_id, rec.rid)
    if arr is not None:
        return _as_dtype(torch.from_numpy(arr), rec.dtype)
    src = rec.source or ""
    root = _dump_root(run)
    if root is None or not src.partition("#")[0].lower().endswith(SUFFIXES + (".parquet",)):
        return None  # a statistics-only record (its source is the dump.json), or no folder to read
    t = load_source(root, src, name=rec.name, step=rec.step, rank=rec.rank)
    if t is None:
        return None
    rel = src.partition("#")[0]
    shape = rec.stats.shape
    if list(t.shape) != list(shape):
        raise ReadError(f"{rel}: holds a tensor of shape {list(t.shape)} where the session recorded {list(shape)} "
                        f"for {rec.name}; the dump changed after it was ingested")
    t = _as_dtype(_as_torch(t), rec.dtype)
    _check_unchanged(t, rec, rel)
    return t


# statistics that are exact whatever computes them: a tensor read back must have the ones ingest stored
_EXACT_STATS = ("nan_count", "inf_count", "zero_count", "min", "max", "min_abs_nonzero")


def _check_unchanged(t, rec: NamedRecord, rel: str) -> None:
    """A tensor read back from the dump holds what was ingested: its counts and extremes are the stored ones.
    Files without checksums (``.npy``, ``.bin``, ``.safetensors``) replaced or damaged since are caught here
    when the change reaches one of them."""
    s = tensor_stats(t, histogram=False)
    for f in _EXACT_STATS:
        want, got = getattr(rec.stats, f), getattr(s, f)
        if want is None or got is None or (want != want and got != got):  # unknown, or NaN on both sides
            continue
        if want != got:
            raise ReadError(f"{rel}: its {f.replace('_', ' ')} is {got!r} where the session recorded {want!r} for "
                            f"{rec.name}; the dump changed after it was ingested")


def _as_torch(t):
    """A loaded array as a torch tensor (numpy has no bf16/fp8 of torch's: those go through float32, exactly)."""
    torch = _torch()
    if isinstance(t, torch.Tensor):
        return t
    a = np.array(t)  # a copy: loaded arrays may be read-only views of a mapped file
    try:
        return torch.from_numpy(a)
    except TypeError:
        return torch.from_numpy(a.astype(np.float32))


def _scalar_args(run: RunInfo, op: str, records: list[NamedRecord]) -> tuple[dict, dict, Optional[str]]:
    """Non-tensor positional and keyword arguments of an msprobe entry: ({pos: value}, {name: value}, note).
    The ``dump.json`` is read within the limits ingest used; one that cannot be read is a ``ReadError``."""
    root = _dump_root(run)
    src = next((r.source for r in records if r.source), "") or ""
    if root is None or not src:
        return {}, {}, None
    p = Path(src.partition("#")[0])
    for c in ([p.parent.parent / "dump.json", p.parent / "dump.json"] if p.suffix == ".pt" else [p]):
        if c.name != "dump.json":
            continue
        path = contained(root, root, c.as_posix(), what="dump.json", where=src)
        if not os.path.lexists(path):
            continue
        rel = c.as_posix()
        doc = read_json(path, rel, root, what="dump.json")
        data = doc.get("data") if isinstance(doc, dict) else None
        entry = data.get(op) if isinstance(data, dict) else None
        if not isinstance(entry, dict):
            return {}, {}, f"{rel} has no entry {op!r}; used the op's default arguments"
        args, kwargs = entry.get("input_args"), entry.get("input_kwargs")
        pos = {i: _json_value(a) for i, a in enumerate(args if isinstance(args, list) else []) if _is_scalar(a)}
        kw = {k: _json_value(a) for k, a in (kwargs if isinstance(kwargs, dict) else {}).items() if _is_scalar(a)}
        return pos, kw, None
    return {}, {}, None


def _is_scalar(a) -> bool:
    """A non-tensor argument: ``{"type": "int", "value": 3}`` or a list of them (a shape)."""
    if isinstance(a, dict):
        return "value" in a
    return isinstance(a, list) and bool(a) and all(isinstance(x, dict) and "value" in x for x in a)


def _json_value(a):
    if isinstance(a, list):
        return tuple(x.get("value") for x in a)
    v = a.get("value")
    if a.get("type") in ("torch.Size", "tuple", "list") and isinstance(v, list):
        return tuple(v)
    return v


@dataclass(frozen=True, slots=True)
class ReplayableOp:
    """A forward op replay can handle: its name, its type as dumped, the op it replays as, its place in execution
    order and whether it holds NaN/Inf."""

    op: str
    op_type: Optional[str]
    replay_as: str
    seq: int
    nonfinite: bool


def replayable_ops(store, session: str, run: Optional[str] = None) -> list[ReplayableOp]:
    """Forward ops of a session's candidate run that replay can handle."""
    info = store.session(session)
    r = _pick_run(store, info, run)
    rows = q.forward_ops(store, r.run_id)
    return [ReplayableOp(x.op, x.op_type, canonical_op(x.op_type or ""), x.seq, bool(x.nonfinite))
            for x in rows if canonical_op(x.op_type or "")]


def _pick_run(store, info: SessionRow, run: Optional[str]) -> RunInfo:
    runs = q.session_runs(store, info.session_id)
    if run is not None:
        hit = [r for r in runs if run in (r.run_id, r.name)]
        if not hit:
            raise ReplayError(f"session {info.name!r} has no run {run!r} "
                              f"(runs: {', '.join(r.name for r in runs)})")
        return hit[0]
    cands = [r for r in runs if r.kind != "reference"] or runs
    if not cands:
        raise ReplayError(f"session {info.name!r} has no runs")
    return cands[0]


def replay_op(store, session: str, op: str, *, fixes=(), run: Optional[str] = None, step: int = 0,
              rank: int = 0, read_limits: Optional[ReadLimits] = None) -> ReplayResult:
    """Replay one op of a stored dump session (see the module doc).  ``read_limits`` bound what a dump file
    may make the loader hold, as at ingest (default: ``ReadLimits()``); a file that fails a check raises
    ``ReadError`` naming it."""
    with limits_in_force(read_limits):
        return _replay_op(store, session, op, fixes, run, step, rank)


def _replay_op(store, session: str, op: str, fixes, run: Optional[str], step: int, rank: int) -> ReplayResult:
    torch = _torch()
    info = store.session(session)
    r = _pick_run(store, info, run)
    recs = [x for x in q.op_records(store, r.run_id, op, step, rank) if x.direction == "forward"]
    if not recs:
        raise ReplayError(f"run {r.name!r} of session {info.name!r} has no forward op {op!r} "
                          f"at step {step}, rank {rank}")
    op_type = recs[0].op_type or ""
    name = canonical_op(op_type)
    if name is None:
        raise ReplayError(f"op {op!r} has type {op_type!r}, which replay does not know; replayable types: "
                          f"{', '.join(REPLAY_OPS)}")
    notes = []
    tensors = _op_tensors(store, r, op, recs)
    pos_scalars, kw_scalars, note = _scalar_args(r, op, recs)
    if note:
        notes.append(note)
    args, kwargs = _assemble(name, tensors, pos_scalars, kw_scalars)
    if not args:
        raise ReplayError(f"op {op!r}: no input tensors were recorded")
    dumped = tensors.get(("output", "0"))
    out_rec = next((x for x in recs if x.role == "output"), None)
    fmt = format_for_dtype(out_rec.dtype) if out_rec else None
    if fmt is None or fmt.name not in ("fp32", "fp16", "bf16"):
        fmt = format_for_dtype(r.dtype) or FORMATS["fp32"]
    policy = _run_policy(r, fmt)
    if name in ("layer_norm",) and not pos_scalars and not kw_scalars:
        notes.append("epsilon and normalized shape were not in the dump: used eps 1e-5 and the weight's shape")
    label = fix_label(fixes) if fixes else None
    outs = replay(op_type, args, kwargs, cand_format=fmt.name, policy=policy, fixes=fixes, op_name=op)
    result = ReplayResult(op=op, op_type=op_type, replay_as=name, run_id=r.run_id, cand_format=fmt.name,
                          fix=label, policy=policy.describe(), notes=notes)
    if dumped is not None:
        result.outputs["dumped"] = dumped
    result.outputs.update(outs.named())
    _compare_outputs(result, outs, dumped)
    if outs.fixed is not None and not torch.isfinite(outs.fixed).all():
        notes.append("the fixed replay still holds non-finite values")
    return result


def _op_tensors(store, r: RunInfo, op: str, recs: list) -> dict[tuple[str, str], Any]:
    """``(role, index)`` -> the tensor of each of the op's records there is one for; every input must have one."""
    tensors: dict[tuple[str, str], Any] = {}
    for rec in recs:
        t = _load_tensor(store, r, rec)
        if t is None and rec.role != "output":
            raise ReplayError(
                f"op {op!r}: the {rec.role} {rec.index} tensor is not available (only its statistics were "
                "dumped or kept); ingest a tensor-mode dump with --keep-tensors, or keep the dump folder in place")
        if t is not None:
            tensors[(rec.role, rec.index)] = t
    return tensors


def _run_policy(r: RunInfo, fmt) -> PrecisionPolicy:
    """The policy the run recorded, else computing in ``fmt`` (fp16 or bf16; fp32 for any other)."""
    if r.policy:
        try:
            return PrecisionPolicy.from_json(r.policy)
        except ValueError:
            pass
    return PrecisionPolicy("dump", fmt.name if fmt.name in ("fp16", "bf16") else "fp32")


def _compare_outputs(result: ReplayResult, outs: ReplayOutputs, dumped) -> None:
    """Each output against the fp32 replay (where the shapes agree), and the candidate replay against the dump."""
    ref = outs.fp32
    for k, t in result.outputs.items():
        if k == "fp32" or not _is_tensor(t) or tuple(t.shape) != tuple(ref.shape):
            continue
        tf = format_for_dtype(t.dtype)
        result.comparisons[f"{k} vs fp32"] = compare(ref, t, cand_format=tf.name if tf else None)
    if dumped is not None and tuple(dumped.shape) == tuple(outs.candidate.shape):
        result.comparisons["candidate vs dumped"] = compare(dumped, outs.candidate)


def _assemble(name: str, tensors: dict, pos_scalars: dict, kw_scalars: dict) -> tuple[list, dict]:
    """Positional args and kwargs from recorded tensors (``input.i``, ``kwarg.k``, ``param.p``) and scalars."""
    inputs = {}
    for (role, idx), t in tensors.items():
        if role == "input":
            try:
                inputs[int(str(idx).split(".")[0])] = t
            except ValueError:
                continue
    for i, v in pos_scalars.items():
        inputs.setdefault(i, v)
    args = [inputs[i] for i in sorted(inputs)] if inputs else []
    # positions are contiguous in a dump entry; a gap means an argument was not recorded
    if inputs and sorted(inputs) != list(range(len(inputs))):
        args = [inputs.get(i) for i in range(max(inputs) + 1)]
    kwargs = dict(kw_scalars)
    for (role, idx), t in tensors.items():
        if role == "kwarg":
            kwargs[str(idx)] = t
    params = {str(idx): t for (role, idx), t in tensors.items() if role == "param"}
    if params:
        # a module entry: its parameters complete the functional signature
        if name == "linear":
            args = args[:1] + [params.get("weight"), params.get("bias")]
        elif name == "layer_norm":
            w = params.get("weight")
            args = args[:1] + [tuple(w.shape) if w is not None else None, w, params.get("bias")]
        elif name == "rms_norm":
            w = params.get("weight")
            args = args[:1] + [tuple(w.shape) if w is not None else None, w]
    return args, kwargs

