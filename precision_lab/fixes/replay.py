"""Op replay for dump-only sessions: re-run one dumped op from its dumped inputs.

When a tensor-mode dump holds an op's inputs and the op type is known,
``replay_op(store, session, op, fixes=...)`` recomputes it on CPU

- in fp32 from the inputs upcast (what the op should have produced from the
  values it was given: its *local* error reference),
- in the candidate's format exactly as the framework does (to check that the
  replay reproduces the dumped output),
- and in the candidate's format under a fix (``keep-fp32:<op>``,
  ``use-bf16``, ``eps:<v>``, ``scale-fp32`` for a fake-quant op, ...),

and compares each with ``metrics.compare`` against the dumped output and the
fp32 replay.  Inputs come from tensors kept in the store (``ingest
--keep-tensors``) or, when the dump folder is still on disk, from its files
(``torch.load(..., weights_only=True)`` only).  Non-tensor arguments
(LayerNorm's shape and epsilon, softmax's dim) are read from msprobe's
``dump.json`` next to the tensors; where it is missing the op's defaults are
used and the result says so.

Framework ops are replayed with torch's own kernels (``F.layer_norm``,
``F.softmax``: torch already subtracts the max and accumulates LayerNorm
statistics in fp32 on CPU), so algorithm fixes do not change them; format
fixes do.  Fake-quant ops of Precision Lab's own captures replay with the
run's policy, so scale fixes apply.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..formats import FORMATS, format_for_dtype
from .catalogue import apply_fixes, fix_label
from .policy import PrecisionPolicy, module_matches

# A replay "reproduces" a dumped output within this many units in the last place: the same fp16 kernel
# on another CPU (other vector width, fused multiply-add) may round an accumulation differently.
REPRODUCE_ULPS = 2.0

__all__ = ["ReplayError", "ReplayResult", "replay_op", "replay", "REPLAY_OPS", "replayable_ops", "canonical_op"]


class ReplayError(ValueError):
    """An op cannot be replayed; the message names the op and what is missing."""


def _torch():
    import torch

    return torch


# ---- op table ------------------------------------------------------------------------

def _linear(args, kw, pol):
    F = _torch().nn.functional
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kw.get("bias")
    return F.linear(x, w, b)


def _matmul(args, kw, pol):
    return _torch().matmul(args[0], args[1])


def _layer_norm(args, kw, pol):
    F = _torch().nn.functional
    x = args[0]
    shape = args[1] if len(args) > 1 and not _is_tensor(args[1]) else kw.get("normalized_shape")
    w = _arg(args, kw, 2, "weight")
    b = _arg(args, kw, 3, "bias")
    eps = _arg(args, kw, 4, "eps")
    if shape is None:
        shape = tuple(w.shape) if w is not None else (x.shape[-1],)
    if isinstance(shape, int):
        shape = (shape,)
    eps = 1e-5 if eps is None else float(eps)
    if pol.eps is not None:
        eps = pol.eps
    return F.layer_norm(x, tuple(shape), w, b, eps)


def _rms_norm(args, kw, pol):
    from .modules import rms_norm

    x = args[0]
    w = _arg(args, kw, 2, "weight")
    eps = _arg(args, kw, 3, "eps")
    eps = pol.eps if pol.eps is not None else (1e-6 if eps is None else float(eps))
    sd = _torch().float32 if pol.stats_fp32 else None
    return rms_norm(x, w, eps, stats_dtype=sd, ftz=pol.flush_to_zero)


def _softmax(args, kw, pol):
    F = _torch().nn.functional
    dim = _arg(args, kw, 1, "dim")
    return F.softmax(args[0], dim=-1 if dim is None else int(dim))


def _unary(name):
    def run(args, kw, pol):
        torch = _torch()
        F = torch.nn.functional
        fn = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "exp": torch.exp, "rsqrt": torch.rsqrt,
              "reciprocal": torch.reciprocal, "sqrt": torch.sqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[name]
        if name == "gelu":
            approx = _arg(args, kw, 1, "approximate")
            return F.gelu(args[0], approximate=approx or "none")
        return fn(args[0])

    return run


def _binary(name):
    def run(args, kw, pol):
        torch = _torch()
        a = args[0]
        b = args[1] if len(args) > 1 else kw.get("other")
        fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[name]
        return fn(a, b)

    return run


def _quantise(args, kw, pol):
    from .modules import fake_quant

    if pol.quant is None:
        raise ReplayError("a quantise op needs a policy with fp8 fake-quant settings; this run has none "
                          "(apply e.g. fp8-format:fp8_e4m3fn to a policy that quantises)")
    return fake_quant(args[0], pol.quant)


@dataclass(frozen=True)
class ReplayOp:
    name: str
    run: Callable
    aliases: tuple[str, ...] = ()
    quantises: bool = False


REPLAY_OPS: dict[str, ReplayOp] = {}
_ALIASES: dict[str, str] = {}


def _register(op: ReplayOp) -> None:
    REPLAY_OPS[op.name] = op
    for a in (op.name,) + op.aliases:
        _ALIASES[a.lower()] = op.name


for _op in (
    ReplayOp("linear", _linear, ("Linear",)),
    ReplayOp("matmul", _matmul, ("mm", "bmm", "MatMul")),
    ReplayOp("layer_norm", _layer_norm, ("LayerNorm", "layernorm")),
    ReplayOp("rms_norm", _rms_norm, ("RMSNorm", "rmsnorm")),
    ReplayOp("softmax", _softmax, ("Softmax", "_softmax")),
    ReplayOp("gelu", _unary("gelu"), ("GELU",)),
    ReplayOp("silu", _unary("silu"), ("SiLU",)),
    ReplayOp("relu", _unary("relu"), ("ReLU",)),
    ReplayOp("exp", _unary("exp")),
    ReplayOp("rsqrt", _unary("rsqrt")),
    ReplayOp("reciprocal", _unary("reciprocal"), ("Reciprocal",)),
    ReplayOp("add", _binary("add"), ("__add__", "__radd__", "Add", "iadd")),
    ReplayOp("sub", _binary("sub"), ("__sub__", "subtract")),
    ReplayOp("mul", _binary("mul"), ("__mul__", "__rmul__", "Mul", "multiply")),
    ReplayOp("div", _binary("div"), ("__truediv__", "truediv", "divide", "true_divide")),
    ReplayOp("quantise", _quantise, ("FakeQuant", "quantize", "quantise", "fake_quant"), quantises=True),
):
    _register(_op)
del _op


def canonical_op(op_type: str) -> Optional[str]:
    """The replay op for an op type (``__truediv__`` -> ``div``, ``LayerNorm`` -> ``layer_norm``), or None."""
    if not op_type:
        return None
    return _ALIASES.get(op_type.lower()) or _ALIASES.get(op_type.strip("_").lower())


def _is_tensor(x) -> bool:
    return isinstance(x, _torch().Tensor)


def _arg(args, kw, pos, name):
    if name in kw:
        return kw[name]
    return args[pos] if len(args) > pos else None


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
        from ..stats import tensor_stats

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

def _rows(store, sql, params):
    cur = store.sql(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _as_dtype(t, dtype_name: Optional[str]):
    """A stored image back in the record's own dtype (the store keeps bf16/fp8 as float32)."""
    fmt = format_for_dtype(dtype_name) if dtype_name else None
    if fmt is not None and fmt.torch_dtype() is not None and t.dtype != fmt.torch_dtype():
        return t.to(fmt.torch_dtype())
    return t


def _load_tensor(store, run: dict, rec: dict):
    """The record's tensor: kept in the store, else read from the dump folder (``.pt`` or a shard)."""
    torch = _torch()
    arr = store.tensor(run["run_id"], rec["rid"])
    if arr is not None:
        return _as_dtype(torch.from_numpy(arr), rec.get("dtype"))
    src = rec.get("source") or ""
    root = Path(run.get("source") or "")
    path = Path(src) if Path(src).is_absolute() else root / src
    if not src or not path.is_file():
        return None
    if src.endswith(".pt"):
        t = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor):
            raise ReplayError(f"{path}: holds a {type(t).__name__}, expected one tensor")
        return t
    if src.endswith(".parquet"):
        import pyarrow.parquet as pq

        from ..store import _npy_load

        table = pq.read_table(path, columns=["name", "step", "rank", "tensor_npy"],
                              filters=[("name", "=", rec["name"])])
        for row in table.to_pylist():
            if row["tensor_npy"] is not None and int(row["step"]) == int(rec["step"]) \
                    and int(row["rank"]) == int(rec["rank"]):
                return _as_dtype(torch.from_numpy(_npy_load(row["tensor_npy"])), rec.get("dtype"))
    return None


def _scalar_args(run: dict, op: str, records: list[dict]) -> tuple[dict, dict, Optional[str]]:
    """Non-tensor positional and keyword arguments of an msprobe entry: ({pos: value}, {name: value}, note)."""
    root = Path(run.get("source") or "")
    src = next((r.get("source") for r in records if r.get("source")), "") or ""
    candidates = []
    if src:
        p = Path(src)
        candidates = [p.parent.parent / "dump.json", p.parent / "dump.json"] if p.suffix == ".pt" else [p]
    for c in candidates:
        path = root / c
        if path.is_file() and path.name == "dump.json":
            try:
                data = json.loads(path.read_text()).get("data", {})
            except (OSError, ValueError) as e:
                return {}, {}, f"could not read {path} for the op's non-tensor arguments ({e}); used defaults"
            entry = data.get(op)
            if not isinstance(entry, dict):
                return {}, {}, f"{path} has no entry {op!r}; used the op's default arguments"
            pos = {i: _json_value(a) for i, a in enumerate(entry.get("input_args", [])) if _is_scalar(a)}
            kw = {k: _json_value(a) for k, a in (entry.get("input_kwargs") or {}).items() if _is_scalar(a)}
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


# ---- replay --------------------------------------------------------------------------------

def _cast_tree(args, dtype):
    torch = _torch()
    conv = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    if isinstance(args, dict):
        return {k: conv(v) for k, v in args.items()}
    return [conv(a) for a in args]


def _compute(op: ReplayOp, args, kw, pol: PrecisionPolicy, fmt_name: str):
    torch = _torch()
    from .modules import flush_subnormals

    dtype = FORMATS[fmt_name].torch_dtype()
    a, k = _cast_tree(args, dtype), _cast_tree(kw, dtype)
    if pol.flush_to_zero:
        a = [flush_subnormals(t) if _is_tensor(t) else t for t in a]
    with torch.no_grad():
        y = op.run(a, k, pol)
    if pol.flush_to_zero and _is_tensor(y):
        y = flush_subnormals(y)
    return y


def replay(op_type: str, args: list, kwargs: Optional[dict] = None, *, cand_format: str = "fp16",
           policy: Optional[PrecisionPolicy] = None, fixes=(), op_name: str = "") -> dict[str, Any]:
    """Replay an op from given arguments: ``{"fp32", "candidate", "fixed"?}`` outputs.

    ``policy`` (default: compute in ``cand_format``) is how the candidate
    ran; ``fixes`` edit it for the ``fixed`` output.  ``keep-fp32`` fixes
    whose pattern matches ``op_name`` replay the op in fp32.
    """
    name = canonical_op(op_type)
    if name is None:
        raise ReplayError(f"op type {op_type!r} cannot be replayed; replayable: {', '.join(REPLAY_OPS)}")
    op = REPLAY_OPS[name]
    kwargs = kwargs or {}
    pol = policy or PrecisionPolicy("dump", cand_format if cand_format in ("fp16", "bf16", "fp32") else "fp32")
    out = {"fp32": _compute(op, args, kwargs, PrecisionPolicy("fp32", "fp32", quant=pol.quant) if op.quantises
                            else PrecisionPolicy("fp32"), "fp32")}
    if op.quantises:
        # the fp32 reference of a quantise op is the unquantised value
        out["fp32"] = _cast_tree([args[0]], FORMATS["fp32"].torch_dtype())[0]
    out["candidate"] = _compute(op, args, kwargs, pol, _fmt_for(pol, op_name, cand_format))
    if fixes:
        fixed = apply_fixes(pol, fixes)
        out["fixed"] = _compute(op, args, kwargs, fixed, _fmt_for(fixed, op_name, cand_format))
    return out


def _fmt_for(pol: PrecisionPolicy, op_name: str, cand_format: str) -> str:
    """The format an op replays in under a policy: an override naming it, else the policy's default."""
    for pattern, f in reversed(pol.overrides):
        if op_name and (module_matches(op_name, pattern) or op_name.startswith(pattern + ".")):
            return f
    if pol.dtype != "fp32" or cand_format not in ("fp16", "bf16"):
        return pol.dtype
    return cand_format


def replayable_ops(store, session: str, run: Optional[str] = None) -> list[dict]:
    """Forward ops of a session's candidate run that replay can handle: ``{op, op_type, replay_as, seq, nonfinite}``."""
    info = store.session(session)
    r = _pick_run(store, info, run)
    rows = _rows(store, """SELECT op, any_value(op_type) AS op_type, min(seq) AS seq, bool_or(nonfinite) AS nf
                           FROM tensors WHERE run_id = ? AND direction = 'forward'
                           GROUP BY step, rank, op ORDER BY min(step), min(seq)""", [r["run_id"]])
    return [{"op": x["op"], "op_type": x["op_type"], "replay_as": canonical_op(x["op_type"] or ""),
             "seq": x["seq"], "nonfinite": bool(x["nf"])} for x in rows if canonical_op(x["op_type"] or "")]


def _pick_run(store, info: dict, run: Optional[str]) -> dict:
    runs = _rows(store, "SELECT * FROM runs WHERE session_id = ? ORDER BY created, run_id", [info["session_id"]])
    if run is not None:
        hit = [r for r in runs if run in (r["run_id"], r["name"])]
        if not hit:
            raise ReplayError(f"session {info['name']!r} has no run {run!r} "
                              f"(runs: {', '.join(r['name'] for r in runs)})")
        return hit[0]
    cands = [r for r in runs if r["kind"] != "reference"] or runs
    if not cands:
        raise ReplayError(f"session {info['name']!r} has no runs")
    return cands[0]


def replay_op(store, session: str, op: str, *, fixes=(), run: Optional[str] = None, step: int = 0,
              rank: int = 0) -> ReplayResult:
    """Replay one op of a stored dump session (see the module doc)."""
    torch = _torch()
    from ..metrics import compare

    info = store.session(session)
    r = _pick_run(store, info, run)
    recs = _rows(store, """SELECT * FROM tensors WHERE run_id = ? AND op = ? AND step = ? AND rank = ?
                           AND direction = 'forward' ORDER BY seq, rid""", [r["run_id"], op, step, rank])
    if not recs:
        raise ReplayError(f"run {r['name']!r} of session {info['name']!r} has no forward op {op!r} "
                          f"at step {step}, rank {rank}")
    op_type = recs[0]["op_type"] or ""
    name = canonical_op(op_type)
    if name is None:
        raise ReplayError(f"op {op!r} has type {op_type!r}, which replay does not know; replayable types: "
                          f"{', '.join(REPLAY_OPS)}")
    notes = []
    tensors: dict[tuple[str, str], Any] = {}
    for rec in recs:
        t = _load_tensor(store, r, rec)
        if t is None and rec["role"] != "output":
            raise ReplayError(
                f"op {op!r}: the {rec['role']} {rec['index']} tensor is not available (only its statistics were "
                "dumped or kept); ingest a tensor-mode dump with --keep-tensors, or keep the dump folder in place")
        if t is not None:
            tensors[(rec["role"], str(rec["index"]))] = t
    pos_scalars, kw_scalars, note = _scalar_args(r, op, recs)
    if note:
        notes.append(note)
    args, kwargs = _assemble(name, tensors, pos_scalars, kw_scalars)
    if not args:
        raise ReplayError(f"op {op!r}: no input tensors were recorded")
    dumped = tensors.get(("output", "0"))
    out_rec = next((x for x in recs if x["role"] == "output"), None)
    fmt = format_for_dtype(out_rec["dtype"]) if out_rec else None
    if fmt is None or fmt.name not in ("fp32", "fp16", "bf16"):
        fmt = format_for_dtype(r.get("dtype")) or FORMATS["fp32"]
    policy = None
    if r.get("policy"):
        try:
            policy = PrecisionPolicy.from_json(r["policy"])
        except ValueError:
            policy = None
    if policy is None:
        policy = PrecisionPolicy("dump", fmt.name if fmt.name in ("fp16", "bf16") else "fp32")
    if name in ("layer_norm",) and not pos_scalars and not kw_scalars:
        notes.append("epsilon and normalized shape were not in the dump: used eps 1e-5 and the weight's shape")
    label = fix_label(fixes) if fixes else None
    outs = replay(op_type, args, kwargs, cand_format=fmt.name, policy=policy, fixes=fixes, op_name=op)
    result = ReplayResult(op=op, op_type=op_type, replay_as=name, run_id=r["run_id"], cand_format=fmt.name,
                          fix=label, policy=policy.describe(), notes=notes)
    if dumped is not None:
        result.outputs["dumped"] = dumped
    result.outputs.update(outs)
    ref = outs["fp32"]
    for k, t in result.outputs.items():
        if k == "fp32" or not _is_tensor(t) or tuple(t.shape) != tuple(ref.shape):
            continue
        tf = format_for_dtype(t.dtype)
        result.comparisons[f"{k} vs fp32"] = compare(ref, t, cand_format=tf.name if tf else None)
    if dumped is not None and tuple(dumped.shape) == tuple(outs["candidate"].shape):
        result.comparisons["candidate vs dumped"] = compare(dumped, outs["candidate"])
    if "fixed" in outs and not torch.isfinite(outs["fixed"]).all():
        notes.append("the fixed replay still holds non-finite values")
    return result


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

