"""Which non-finite values are intended, where an op call ran (its nesting), and each op call of the facts with
what its non-finite records mean (``_classify``)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Optional

from ..ops import CONSTANT_OPS, MASKING_OPS, canonical, module_path
from ..records import INPUT_ROLES, STATE_ROLES
from ..stats import TensorStats
from .values import ComparedRecord, NonfiniteCall, RunFacts, _Event


def is_additive_mask(st: TensorStats) -> bool:
    """Whether a tensor holding ``-inf`` is an additive mask: every non-finite value is ``-inf`` and every
    finite one is 0 (a 0/1 mask times ``finfo.min`` that overflowed to ``-inf`` in a narrower format).  From
    the counts where known, else from a summary's Min (``-inf``) and Max (0)."""
    if st.negative_inf_only is not True:
        return False
    if st.zero_count is not None and st.inf_count is not None and st.numel:
        return st.zero_count + st.inf_count == st.numel
    return st.max == 0


def intended_output(op_type: Optional[str], st: TensorStats, *, received_mask: bool, read_tensors: bool,
                    inside_intended: bool = False) -> bool:
    """Whether an output's non-finite values are no error by itself (see the module doc): the one rule the
    producer, the intended list, ``bisect``/``verify`` and the alerts share."""
    if st.negative_inf_only is not True:
        return False
    kind = canonical(op_type)
    return bool(kind in MASKING_OPS or kind in CONSTANT_OPS or not read_tensors or received_mask
                or inside_intended or is_additive_mask(st))


def _kinds(st: TensorStats) -> frozenset:
    """The kinds of non-finite value a tensor holds: ``nan``, ``+inf``, ``-inf``; from the counts where known,
    else from a summary's Min and Max; a non-finite value of no known kind counts as ``nan`` (anything)."""
    k = set()
    if (st.nan_count or 0) > 0:
        k.add("nan")
    inf = st.inf_count or 0
    if inf and st.neg_inf_count is not None:
        if st.neg_inf_count:
            k.add("-inf")
        if inf > st.neg_inf_count:
            k.add("+inf")
    elif inf or st.nan_count is None:
        for v, word in ((st.min, "-inf"), (st.max, "+inf")):
            if v is not None and math.isinf(v) and (v < 0) == (word == "-inf"):
                k.add(word)
            elif v is not None and math.isnan(v):
                k.add("nan")
    if not k and st.has_nonfinite:
        k.add("nan")
    return frozenset(k)


def _backward(op: str) -> bool:
    """Whether an op's name says it ran in the backward pass (``x.backward``, ``Functional.linear.3.backward``,
    ``Module.fc.Linear.backward.0``)."""
    return "backward" in op.split(".")


_NUMBERED = re.compile(r"^\d+[-_]")


def _inside(op: str, container: str, parents: Optional[Mapping] = None) -> bool:
    """Whether ``op`` ran inside ``container``: by the dump's own nesting (``parents``: op -> enclosing module
    call, msprobe's construct.json) or by name (``container``'s module path followed by a dot begins ``op``).
    A backward op never ran inside a forward one (``softmax.0.backward`` is not inside ``softmax.0``)."""
    if op == container or _backward(op) != _backward(container):
        return False
    # a call number a dump's file names begin with (003-layers.1.0, 009_layers.1) is no part of the module path
    bare, scope = _NUMBERED.sub("", op), module_path(_NUMBERED.sub("", container))
    if bare != _NUMBERED.sub("", container) and (scope == "" or bare.startswith(scope + ".")):
        return True
    seen = 0
    p = (parents or {}).get(op)
    while p is not None and seen < 256:  # a parent chain that loops ends here
        if p == container:
            return True
        p, seen = parents.get(p), seen + 1
    return False


def _classify(facts: RunFacts, *, use_reference: bool) -> list[_Event]:
    """Each op call of the facts with what its non-finite records mean (``_Event``).

    A record compared with a reference is unexpected when it holds non-finite values the reference does not
    (``use_reference``); one the reference lacks is judged as below when its op received only finite values
    and the run carried none of the reference's own, else taken as passed on.  Otherwise an input carrying
    only ``-inf`` is a mask (expected), and an output is judged by ``intended_output``."""
    by_call: dict[tuple, list[ComparedRecord]] = {}
    for r in facts.records:
        by_call.setdefault((r.step, r.rank, r.op), []).append(r)
    intended_scopes: list[tuple] = []
    carried: dict[tuple, bool] = {}  # (step, rank) -> a non-finite value the reference shares was seen
    return [_classify_call(g, by_call.get((g.step, g.rank, g.op), []), facts, use_reference, carried,
                           intended_scopes) for g in facts.calls]


def _classify_call(g: NonfiniteCall, rs: list[ComparedRecord], facts: RunFacts, use_reference: bool,
                   carried: dict[tuple, bool], intended_scopes: list[tuple]) -> _Event:
    """One op call (``g``, its records ``rs``) judged; notes in ``carried`` a reference's own non-finite value
    seen at its step and rank and in ``intended_scopes`` a call that wrote intended ``-inf``, for the calls
    after it."""
    ins = [r for r in rs if r.role in INPUT_ROLES]
    outs = [r for r in rs if r.role not in INPUT_ROLES]
    # an op call that read no tensor at all (a constant), told apart from one whose inputs were finite
    read_tensors = bool(ins) or not facts.inputs_recorded or not g.no_inputs

    def by_reference(r: ComparedRecord) -> bool:
        """Whether the reference decides: a compared record, or (no reference tensor to compare) a received
        value, one passed on from non-finite inputs, or one made after the run already carried the
        reference's own non-finite values (through Python, e.g. torch.tensor(x.item())): those are blamed on
        the op that made the first of them."""
        return use_reference and (r.introduced is not None or r.role in INPUT_ROLES or bool(ins)
                                  or bool(carried.get((g.step, g.rank))))

    def unexpected(r: ComparedRecord) -> bool:
        if by_reference(r):
            return r.introduced is not None and int(r.introduced) > 0
        return r.stats.negative_inf_only is not True

    bad_in = [r for r in ins if unexpected(r)]
    mask_in = any(r not in bad_in for r in ins)
    # the reference's own NaN/inf arriving here (not a mask): what this op adds to them is not its doing
    shared_in = use_reference and any(r not in bad_in and r.stats.negative_inf_only is not True for r in ins)
    # only a -inf output the reference does not decide asks whether an op inside this one wrote intended -inf
    inside = any(r.stats.negative_inf_only is True and not by_reference(r) for r in outs) and any(
        k[:2] == (g.step, g.rank) and _inside(k[2], g.op, facts.parents) for k in intended_scopes)
    bad_out, good_out = [], []
    for r in outs:
        if by_reference(r):
            (bad_out if unexpected(r) else good_out).append(r)
        elif intended_output(g.op_type, r.stats, received_mask=mask_in, read_tensors=read_tensors,
                             inside_intended=inside):
            good_out.append(r)
        else:
            bad_out.append(r)
    if use_reference and any(r.introduced == 0 for r in rs):
        carried[(g.step, g.rank)] = True
    intended_out = (bool(good_out) and not bad_in and not mask_in
                    and all(r.stats.negative_inf_only for r in good_out))
    if intended_out:
        intended_scopes.append((g.step, g.rank, g.op))
    # the reference's own NaN arriving and only NaN leaving is their spread (a calibration poisoned by a NaN
    # row); an inf where the reference is finite is this op's own overflow, whatever else it received
    spread = shared_in and bool(bad_out) and all((r.stats.inf_count or 0) == 0 for r in bad_out)

    def carries(r: ComparedRecord) -> bool:
        """Whether ``r``'s non-finite values can carry a failure: any without a reference; with one, those it
        does not hold (the reference's own are not this run's doing, a mask's ``-inf`` where the reference
        is finite is)."""
        return not use_reference or unexpected(r) or r.newly_nonfinite

    in_kinds = frozenset().union(*(_kinds(r.stats) for r in ins if carries(r)))
    carried_out = [r for r in outs if carries(r)]
    return _event_of(g, in_kinds, carried_out, bad_in, bad_out, good_out, shared_in=shared_in, mask_in=mask_in,
                     spread=spread, intended_out=intended_out)


def _event_of(g: NonfiniteCall, in_kinds: frozenset, carried_out: list[ComparedRecord], bad_in: list[ComparedRecord],
              bad_out: list[ComparedRecord], good_out: list[ComparedRecord], *, shared_in: bool, mask_in: bool,
              spread: bool, intended_out: bool) -> _Event:
    """The ``_Event`` of a judged op call: its unexpected inputs and outputs (``bad_in``, ``bad_out``), its intended
    outputs (``good_out``) and its outputs that can carry a failure (``carried_out``)."""
    return _Event(**{f.name: getattr(g, f.name) for f in dataclasses.fields(NonfiniteCall)},
                  in_kinds=in_kinds | ({"nan"} if spread and not bad_in else frozenset()),
                  out_kinds=frozenset().union(*(_kinds(r.stats) for r in carried_out)),
                  out_rec=carried_out[0] if carried_out else None,
                  nf_in=bool(bad_in) or spread, nf_out=bool(bad_out), shared_in=shared_in,
                  mask_in=mask_in, spread=spread and not bad_in,
                  nan_in=any((r.stats.nan_count or 0) > 0 for r in bad_in),
                  nan_out=any((r.stats.nan_count or 0) > 0 for r in bad_out),
                  intended_out=intended_out,
                  intended_count=sum(int(r.stats.inf_count or 0) for r in good_out),
                  first_rec=bad_out[0] if bad_out else None, first_in=bad_in[0] if bad_in else None,
                  params=tuple(r for r in bad_in if r.role in STATE_ROLES))
