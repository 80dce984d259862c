"""Op replay: re-run one op from given inputs, in fp32, as the candidate ran, and under a fix.

The session-level use case (``services.replay.replay_op``) loads a dumped
op's inputs and calls ``replay`` here, which recomputes it on CPU

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

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..formats import FORMATS
from ..ops import aliases_of, canonical
from ..registry import Registry
from .catalogue import apply_fixes
from .policy import PrecisionPolicy, cast_floating, module_matches

__all__ = ["ReplayError", "ReplayOutputs", "replay", "REPLAY_OPS", "ReplayOp", "register_op", "canonical_op"]


class ReplayError(ValueError):
    """An op cannot be replayed; the message names the op and what is missing."""


def _torch():
    import torch  # deferred: the op table is listed (CLI help, dump sessions) without loading torch

    return torch


def _numerics():
    from . import modules  # deferred with torch: the torch modules the ops share with live capture

    return modules


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
    rms_norm = _numerics().rms_norm
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
    fake_quant = _numerics().fake_quant
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


REPLAY_OPS = Registry("replayable op", group="precision_lab.replay_ops", name_of=lambda op: op.name)


def register_op(op: ReplayOp, *, replace: bool = False) -> ReplayOp:
    """Make an op type replayable (its aliases map to it through ``canonical_op``)."""
    return REPLAY_OPS.register(op.name, op, replace=replace)


for _op in (
    ReplayOp("linear", _linear, aliases_of("linear")),
    ReplayOp("matmul", _matmul, aliases_of("matmul")),
    ReplayOp("layer_norm", _layer_norm, aliases_of("layer_norm")),
    ReplayOp("rms_norm", _rms_norm, aliases_of("rms_norm")),
    ReplayOp("softmax", _softmax, aliases_of("softmax")),
    ReplayOp("gelu", _unary("gelu"), aliases_of("gelu")),
    ReplayOp("silu", _unary("silu"), aliases_of("silu")),
    ReplayOp("relu", _unary("relu"), aliases_of("relu")),
    ReplayOp("exp", _unary("exp"), aliases_of("exp")),
    ReplayOp("rsqrt", _unary("rsqrt"), aliases_of("rsqrt")),
    ReplayOp("reciprocal", _unary("reciprocal"), aliases_of("reciprocal")),
    ReplayOp("add", _binary("add"), aliases_of("add")),
    ReplayOp("sub", _binary("sub"), aliases_of("sub")),
    ReplayOp("mul", _binary("mul"), aliases_of("mul")),
    ReplayOp("div", _binary("div"), aliases_of("div")),
    ReplayOp("quantise", _quantise, aliases_of("quantise"), quantises=True),
):
    register_op(_op)
del _op


def canonical_op(op_type: str) -> Optional[str]:
    """The replay op for an op type (``__truediv__`` -> ``div``, ``LayerNorm`` -> ``layer_norm``), or None."""
    if not op_type:
        return None
    name = canonical(op_type)
    if name in REPLAY_OPS:
        return name
    # a plug-in op's own aliases
    aliases = {a.lower(): op.name for op in REPLAY_OPS.values() for a in (op.name,) + op.aliases}
    return aliases.get(op_type.lower()) or aliases.get(op_type.strip("_").lower())


def _is_tensor(x) -> bool:
    return isinstance(x, _torch().Tensor)


def _arg(args, kw, pos, name):
    if name in kw:
        return kw[name]
    return args[pos] if len(args) > pos else None


# ---- replay --------------------------------------------------------------------------------

def _compute(op: ReplayOp, args, kw, pol: PrecisionPolicy, fmt_name: str):
    torch = _torch()
    flush_subnormals = _numerics().flush_subnormals
    dtype = FORMATS[fmt_name].torch_dtype()
    a, k = cast_floating(list(args), dtype), cast_floating(dict(kw), dtype)
    if pol.flush_to_zero:
        a = [flush_subnormals(t) if _is_tensor(t) else t for t in a]
    with torch.no_grad():
        y = op.run(a, k, pol)
    if pol.flush_to_zero and _is_tensor(y):
        y = flush_subnormals(y)
    return y


@dataclass(frozen=True, slots=True)
class ReplayOutputs:
    """An op replayed: in fp32 (``fp32``), as the candidate ran (``candidate``) and, when fixes were given, under
    them (``fixed``)."""

    fp32: Any
    candidate: Any
    fixed: Any = None

    def named(self) -> tuple[tuple[str, Any], ...]:
        """``(name, tensor)`` of each output there is: ``fp32``, ``candidate``, then ``fixed``."""
        out = (("fp32", self.fp32), ("candidate", self.candidate))
        return out + ((("fixed", self.fixed),) if self.fixed is not None else ())


def replay(op_type: str, args: list, kwargs: Optional[dict] = None, *, cand_format: str = "fp16",
           policy: Optional[PrecisionPolicy] = None, fixes=(), op_name: str = "") -> ReplayOutputs:
    """Replay an op from given arguments (``ReplayOutputs``).

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
    fp32 = _compute(op, args, kwargs, PrecisionPolicy("fp32", "fp32", quant=pol.quant) if op.quantises
                    else PrecisionPolicy("fp32"), "fp32")
    if op.quantises:
        # the fp32 reference of a quantise op is the unquantised value
        fp32 = cast_floating(args[0], FORMATS["fp32"].torch_dtype())
    candidate = _compute(op, args, kwargs, pol, _fmt_for(pol, op_name, cand_format))
    fixed = None
    if fixes:
        fixed_pol = apply_fixes(pol, fixes)
        fixed = _compute(op, args, kwargs, fixed_pol, _fmt_for(fixed_pol, op_name, cand_format))
    return ReplayOutputs(fp32, candidate, fixed)


def _fmt_for(pol: PrecisionPolicy, op_name: str, cand_format: str) -> str:
    """The format an op replays in under a policy: an override naming it, else the policy's default."""
    for pattern, f in reversed(pol.overrides):
        if op_name and (module_matches(op_name, pattern) or op_name.startswith(pattern + ".")):
            return f
    if pol.dtype != "fp32" or cand_format not in ("fp16", "bf16"):
        return pol.dtype
    return cand_format


