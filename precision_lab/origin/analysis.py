"""The answer: ``analyse`` finds a run's failure, walks it back (or, without the model's output, picks the first
op in order that made a non-finite value) and says what it saw, what it inferred and what would settle it."""

from __future__ import annotations

import math
from typing import Mapping, Optional

from ..display import num_text
from ..enums import Certainty, Direction, OriginKind, RunOrder
from ..formats import format_for_dtype
from ..ops import module_path
from ..records import INPUT_ROLES
from .calls import _classify, _inside
from .values import ComparedRecord, Intended, OpRef, Origin, ParameterOrigin, RunFacts, _Event, order_text
from .walk import _explained, _walk


def analyse(facts: RunFacts) -> tuple[Optional[Origin], list[Intended]]:
    """``(origin, intended)`` of a run: the first unexpected non-finite value's origin (None when the run
    holds none: a run whose only NaN/inf are a mask's ``-inf`` is clean) and the op calls that wrote
    intended ``-inf``, in execution order.  ``path`` is left empty: the caller reads it (the op calls before
    the origin are not among the facts)."""
    if not facts.calls:
        return None, []
    compared = any(r.introduced is not None for r in facts.records)
    calls, in_reference = _classified(facts, compared)
    masks = _intended_of(calls)
    intended = tuple(m.op for m in masks)
    events = [c for c in calls if c.nf_in or c.nf_out]
    if not events:
        return None, masks
    order = facts.order
    known = order.known
    outputs_only = not facts.inputs_recorded
    failure = _failure(calls, facts) if facts.outputs else None
    walked = failure is not None and failure is not False
    if failure is None and not known and not any((c.out_kinds | c.in_kinds) - {"-inf"} for c in calls):
        # neither the order nor the model's output is known, and every non-finite value is -inf: nothing became
        # NaN or +inf, as a failure that passes through a layer does (-inf times weights of both signs is NaN)
        return None, _writers(calls)
    if failure is False:
        # nothing unexpected reaches the model's output, a gradient or a parameter: every non-finite value was
        # intended, whatever wrote it
        return None, _writers(calls)
    if walked:
        key, start, failed = failure
        hit, others, kind, guessed, needs = _walked(calls, key, start, facts)
    else:
        hit, others, kind, guessed, needs = _picked(events, facts)
        failed = None
    param = _parameter(hit) if kind is OriginKind.PARAMETER else None
    rec = _record_of(hit, kind, param, facts)
    if walked:  # the module holding the origin (or an op inside it) wrote its value: not listed as intended
        intended = tuple(m.op for m in masks if m.op != hit.op and not _inside(hit.op, m.op, facts.parents)
                         and not _inside(m.op, hit.op, facts.parents))
    reason = _reason(hit, kind, rec, param, others, order=order, walked=walked, failed=failed,
                     in_reference=in_reference, outputs_only=outputs_only)
    if in_reference:
        reason += "; the reference run holds the same non-finite values"
    if intended:
        reason += (f" ({len(intended)} op(s) wrote -inf that is no error by itself (a mask, a constant, or log(0)) "
                   f"and are not blamed: {', '.join(intended[:3])}{', ...' if len(intended) > 3 else ''})")
    first_nan = _first_nan(events, hit) if kind is OriginKind.OP and known else None
    certainty = Certainty.LIKELY if guessed else Certainty.CERTAIN
    return Origin(
        run=facts.run, run_id=facts.run_id, op=hit.op, op_type=hit.op_type, direction=hit.direction,
        seq=hit.seq, step=hit.step, rank=hit.rank, rid=rec.rid, role=rec.role,
        index=rec.index, origin=kind, reason=reason, order=order, order_known=known, certainty=certainty,
        location=rec.location, parent=rec.parent, parameter=param, others=tuple(others),
        in_reference=in_reference, first_nan=first_nan, intended=intended, guessed=tuple(guessed),
        decide=_decide(needs, known, outputs_only, compared) if guessed else None), masks


def _classified(facts: RunFacts, compared: bool) -> tuple[list[_Event], bool]:
    """The op calls judged (``_classify``), and whether they were judged without the reference because the
    reference holds the same non-finite values (``in_reference``)."""
    calls = _classify(facts, use_reference=compared)
    # with a reference, values it shares are no event: a later op that adds its own (an fp16-only overflow after
    # a 0/0 row the fp32 run has too) is still the answer
    first_event = next((c for c in calls if c.nf_in or c.nf_out), None)
    if compared and (first_event is None or first_event.spread):
        # nothing was introduced by the lower precision before the reference's own NaN spread: the reference has
        # the same non-finite values, and the op that made them there is the answer
        return _classify(facts, use_reference=False), True
    return calls, False


def _walked(calls: list[_Event], key: tuple, start: _Event, facts: RunFacts):
    """``(hit, others, kind, guessed, needs)``: the origin of a failure at ``start`` (step and rank ``key``), walked
    back (``_walk``), with the other candidates, what was guessed and what would settle it."""
    order, known = facts.order, facts.order.known
    local = [c for c in calls if (c.step, c.rank) == key]
    w = _walk(local, start, facts.parents, facts.inputs_recorded)
    hit, others, guessed, needs = w.event, list(w.others), list(w.guessed), set(w.needs)
    kind = {"op": OriginKind.OP, "param": OriginKind.PARAMETER}.get(w.kind, OriginKind.INPUT)
    if kind is OriginKind.OP and others:
        # several ops made values that may each have reached the failure (q, k and v of one attention, each
        # quantised with a zero row's scale): the first of them in order is where it started
        pool = [hit] + [c for c in local if c.op in others and not c.params and c.out_kinds >= hit.out_kinds]
        earliest = min(pool, key=lambda c: (c.seq, c.op))
        if earliest is not hit:
            others = [hit.op] + [o for o in others if o != earliest.op]
            hit = earliest
    if kind is OriginKind.OP:
        gap = _gap_inside(local, hit, facts.parents)
        if gap is not None:
            hit, kind = gap, OriginKind.INPUT
    if order is not RunOrder.EXECUTION:
        rivals = [c.op for c in local if c.out_kinds and not _explained(c) and c.op != hit.op
                  and not _inside(c.op, hit.op, facts.parents) and not _inside(hit.op, c.op, facts.parents)
                  and c.op not in others and not any(_inside(o.op, c.op, facts.parents) for o in local
                                                     if o.out_kinds and not _explained(o))]
        others += rivals
        if not known or others:
            needs.add("order")
        if not known:
            guessed.append(f"the run's order is unknown: the ops are placed by name and by how many non-finite "
                           f"values they hold, so which op wrote what {hit.op} is blamed for is inferred")
        elif others:
            guessed.append(f"the run's order is {order_text(order)}: that {hit.op} ran before "
                           f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''} (which also wrote "
                           "non-finite values from finite inputs) is inferred")
    _note_unrecorded_inputs(hit, kind, facts, guessed, needs)
    return hit, others, kind, guessed, needs


def _picked(events: list[_Event], facts: RunFacts):
    """``(hit, others, kind, guessed, needs)`` without the model's output: the first op in order that made a
    non-finite value (``_pick``)."""
    known = facts.order.known
    guessed: list[str] = []
    needs: set[str] = set()
    hit, others, kind = _pick(events, known, facts.parents)
    if not known and others:
        needs.add("order")
        guessed.append(f"the run's order is unknown: {hit.op} is first by name; {', '.join(others[:3])}"
                       f"{', ...' if len(others) > 3 else ''} may have run first")
    _note_unrecorded_inputs(hit, kind, facts, guessed, needs)
    return hit, others, kind, guessed, needs


def _note_unrecorded_inputs(hit: _Event, kind: OriginKind, facts: RunFacts, guessed: list, needs: set) -> None:
    """An op named for making its value whose inputs the dump does not record: that they were finite is a guess."""
    if kind is OriginKind.OP and hit.no_inputs and not facts.inputs_recorded:
        needs.add("inputs")
        guessed.append(f"{hit.op}'s inputs are not recorded: that they were finite is inferred")


def _record_of(hit: _Event, kind: OriginKind, param: Optional[ParameterOrigin], facts: RunFacts) -> ComparedRecord:
    """The record an origin names: the output an op made, the parameter, or the input that arrived."""
    by_call = [r for r in facts.records if (r.step, r.rank, r.op) == (hit.step, hit.rank, hit.op)]
    if kind is OriginKind.OP:
        rec = hit.first_rec or hit.out_rec
    elif param:
        rec = hit.params[0]
    else:
        rec = hit.first_in or next((r for r in by_call if r.role in INPUT_ROLES), None)
    return rec or hit.first_rec or hit.out_rec or by_call[0]


def _others_words(others: list[str]) -> str:
    """How many other ops also qualify and the first of them, closing a parenthesis opened before."""
    return (f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''})" if others else ")")


def _reason(hit: _Event, kind: OriginKind, rec: ComparedRecord, param: Optional[ParameterOrigin], others: list[str],
            *, order: RunOrder, walked: bool, failed: Optional[str], in_reference: bool, outputs_only: bool) -> str:
    """Why the origin is where it is, in words, by what it is and how it was found."""
    known = order.known
    if kind is OriginKind.PARAMETER:
        return param.reason
    if kind is OriginKind.OP and outputs_only:
        reason = (f"{hit.op} is the first module whose output is non-finite (inputs not recorded), the innermost "
                  f"one" + (f", in {order_text(order)}" if known else f" ({order_text(order)}"))
        return reason + _others_words(others) if not known else reason
    if kind is OriginKind.OP and walked:
        reason = f"{hit.op} is where the failure starts: its inputs are all finite and its {rec.role} {rec.index} is not"
        if rec.stats.negative_inf_only:
            reason += _mask_words(rec, failed)
        elif failed:
            reason += f"; that value reaches {failed}"
        return reason + f" ({order_text(order)}" + _others_words(others) if not known else reason
    if kind is OriginKind.OP and known:
        return (f"{hit.op} is the first op whose inputs are all finite and whose {rec.role} "
                f"{rec.index} is not")
    if kind is OriginKind.OP:
        return (f"{hit.op}: its inputs are all finite and its {rec.role} {rec.index} is not, and no op "
                f"inside it is like that ({order_text(order)}, so the innermost such op is named") + _others_words(others)
    if rec.introduced and not in_reference:
        # a gap: the comparison shows this input newly non-finite, and no recorded op wrote it
        return (f"{hit.op} receives a {rec.role} {rec.index} that is newly non-finite (the reference's is "
                "finite), and no recorded op produced it: its producer was not recorded (likely a cast or a view, "
                "e.g. Tensor.to, which some dumpers leave out)")
    reason = (f"{hit.op} already receives a non-finite {rec.role} {rec.index}; no recorded op "
              "produced it (it comes from before the first recorded op, e.g. the model's inputs)")
    return reason + f" ({order_text(order)})" if not known else reason


def _first_nan(events: list[_Event], hit: _Event) -> Optional[OpRef]:
    """For an op that made only inf: the first op at or after it that made NaN from no NaN, if another one."""
    if hit.nan_out:
        return None
    nan_hit = next((c for c in events if c.nan_out and not c.nan_in
                    and (c.step, c.rank, c.seq) >= (hit.step, hit.rank, hit.seq)), None)
    if nan_hit is not None and nan_hit.op != hit.op:
        return OpRef(nan_hit.op, nan_hit.op_type, nan_hit.step, nan_hit.rank, nan_hit.seq)
    return None


def _failure(calls: list[_Event], facts: RunFacts):
    """What failed first: ``(step and rank, the op call to walk back from, the failure in words)``; False when
    nothing unexpected reaches the model's output, a gradient or a parameter (the run is healthy)."""
    keys = list(dict.fromkeys((c.step, c.rank) for c in calls))
    for key in keys:
        local = [c for c in calls if (c.step, c.rank) == key]
        out, root = facts.outputs.get(key, (None, False))
        if root and any(c.nf_out and c.op != out and not _inside(c.op, out, facts.parents) for c in local):
            root = False  # an op not inside it wrote a failure: it is no root (a nesting found from the data)
        sink = next((c for c in local if c.op == out), None)
        if sink is not None and sink.nf_out:
            return key, sink, f"the model's output ({sink.op})" if root else f"the last op's output ({sink.op})"
        grads = [c for c in local if c.direction is Direction.BACKWARD and c.nf_out]
        if grads:
            return key, grads[-1], f"the gradients ({grads[-1].op})"
        held = [c for c in local if any(_state_failed(r) for r in c.params)]
        if held:
            return key, held[0], f"a parameter of {held[0].op}"
        if out is None or (not root and any(c.first_rec is not None and (c.first_rec.introduced or 0) > 0
                                            for c in local)):
            # this step and rank's output is not known, or only guessed (a dump without a root, which may leave
            # the model's output out) while the reference shows values newly non-finite: those are the failure
            bad = [c for c in local if c.nf_out]
            if bad:
                return key, bad[-1], f"{bad[-1].op}'s output"
    return False


def _state_failed(r: ComparedRecord) -> bool:
    """Whether a non-finite parameter or buffer is a failure by itself: a parameter always; a buffer when the
    reference holds finite values there (a running variance that overflowed in the cast), or, without a
    reference, when it holds finite values beside the non-finite ones.  A buffer of nothing but +-inf (the start
    of a running min, TransformerLens's ``IGNORE``) is a constant, a failure only where its value reaches one."""
    if r.role != "buffer":
        return True
    if r.introduced is not None:
        return r.newly_nonfinite
    st = r.stats
    return not (st.numel and (st.inf_count or 0) + (st.nan_count or 0) == st.numel)


def _writers(calls: list[_Event]) -> list[Intended]:
    """Every op call that wrote a non-finite value it did not receive, in execution order: in a run whose
    failures hold none, each of them was intended."""
    return [Intended(c.op, c.op_type, c.step, c.rank, c.seq,
                     sum(int((r.stats.nan_count or 0) + (r.stats.inf_count or 0)) for r in (c.out_rec,) if r))
            for c in calls if (c.out_kinds or c.intended_out) and not _explained(c) and not c.mask_in] or \
        _intended_of(calls)


def _mask_words(rec: ComparedRecord, failed: Optional[str]) -> str:
    """Why a ``-inf`` that looks like a mask's is blamed: it reaches the failure (a fully masked row becomes NaN),
    and, where the reference holds a finite ``finfo.min`` there, the cast is what made it ``-inf``."""
    words = "; its -inf looks like a mask's, but it reaches " + (failed or "the failure")
    if rec.newly_nonfinite and (rec.masked or 0) > 0:
        fmt = format_for_dtype(rec.dtype)
        words += (f" (where the reference holds a finite mask value, below -{num_text(fmt.max, grouped=True)}, "
                  f"{fmt.name}'s most negative number: it became -inf in the cast)" if fmt is not None and
                  fmt.kind == "float" else " (the reference holds a finite value there)")
    return words + ": a row masked throughout turns into NaN where -inf meets -inf (softmax, 0 x -inf, -inf - -inf)"


def _decide(needs: set[str], known: bool, outputs_only: bool, compared: bool) -> str:
    """What would settle an answer that guessed: the evidence it lacked (``needs``: ``order``, ``inputs``,
    ``links``)."""
    need = []
    if not known or "order" in needs:
        need.append("the order the ops ran in (an order list, such as a manifest's call order, or a capture)")
    if outputs_only or "inputs" in needs:
        need.append("each op's inputs (a dump that records inputs as well as outputs)")
    if "links" in needs:
        need.append("which op's output each op read (tensor dumps, whose values link outputs to inputs)"
                    + ("" if compared else ", or an fp32 reference run, which shows which non-finite values are new"))
    return "; ".join(need) or "a capture of the run (order, inputs and a reference recorded)"


def _pick(events: list[_Event], known: bool,
          parents: Optional[Mapping] = None) -> tuple[_Event, list[str], OriginKind]:
    """(the call named, other candidates when the order is unknown, what the origin is).

    A candidate has no unexpected non-finite input and an unexpected non-finite output.  A candidate with
    another candidate inside it (same step and rank) is a module passing the value on: the innermost one is
    named.  When the first event is an op that *receives* a non-finite value no earlier op produced, a
    parameter of it (or of a module around it) that is already non-finite is the origin; else the value
    came from before the first record.  With the order unknown, parameters come first, then the innermost
    candidates of the first step and rank, the first by name named and the others listed."""
    cands = [g for g in events if g.nf_out and not g.nf_in]
    first = events[0]
    local = [g for g in events if (g.step, g.rank) == (first.step, first.rank)]
    with_params = [g for g in local if g.params]
    if known:
        if first.nf_out and not first.nf_in:
            hit = first
            lc = [g for g in cands if (g.step, g.rank) == (first.step, first.rank)]
            visited = {hit.op}
            while True:  # inward; a nesting that loops (two ops each said to hold the other) stops
                inner = next((g for g in lc if g.op not in visited and _inside(g.op, hit.op, parents)), None)
                if inner is None:
                    break
                hit = inner
                visited.add(hit.op)
            # a module inside it that holds a non-finite parameter or buffer (a dump that records a module's
            # own weights: the container's output is the first non-finite one, the weight was already inf)
            holder = next((g for g in with_params if g is hit or _inside(g.op, hit.op, parents)), None)
            if holder is None and hit.mask_in and with_params:
                # its input's -inf looked like a mask's, but a non-finite weight of this step wrote it (x * inf)
                holder = with_params[0]
            if holder is not None:
                return holder, [], OriginKind.PARAMETER
            gap = _gap_inside(local, hit, parents)
            return (gap, [], OriginKind.INPUT) if gap is not None else (hit, [], OriginKind.OP)
        holder = next((g for g in with_params if g is first or _inside(first.op, g.op, parents)), None)
        if holder is None and first.params:
            holder = first
        if holder is not None:
            return holder, [], OriginKind.PARAMETER
        return first, [], OriginKind.INPUT
    if with_params:
        return with_params[0], [], OriginKind.PARAMETER
    if not cands:
        return first, [], OriginKind.INPUT
    c0 = cands[0]
    lc = [g for g in cands if (g.step, g.rank) == (c0.step, c0.rank)]
    innermost = sorted((g for g in lc if not any(_inside(o.op, g.op, parents) for o in lc)),
                       key=lambda g: (g.seq, g.op))
    gap = _gap_inside(local, innermost[0], parents)
    if gap is not None:
        return gap, [], OriginKind.INPUT
    return innermost[0], [g.op for g in innermost[1:]], OriginKind.OP


def _gap_inside(local: list[_Event], hit: _Event, parents: Optional[Mapping]) -> Optional[_Event]:
    """The first op inside ``hit`` whose input the comparison shows newly non-finite: the value appeared inside
    ``hit`` from an op the dump does not record (a cast), so that consumer is named, not the container."""
    # a backward op is named after its forward one ("fc1.linear.0.backward") but never ran inside it
    return next((g for g in local if g.nf_in and g.first_in is not None and g.first_in.introduced
                 and g.direction == hit.direction and _inside(g.op, hit.op, parents)), None)


def _parameter(call: _Event) -> ParameterOrigin:
    """The first non-finite parameter (or buffer) of ``call``, named by its module path, with its value
    against the format."""
    r = call.params[0]
    scope = module_path(call.op)
    name = f"{scope}.{r.index}" if scope else str(r.index)
    fmt = format_for_dtype(r.dtype)
    fname = fmt.name if fmt else (r.dtype or "its dtype")
    st = r.stats
    what = " and ".join(s for s in (f"{st.nan_count:,} NaN" if st.nan_count else "",
                                    f"{st.inf_count:,} inf" if st.inf_count else "") if s) or "non-finite values"
    ref = r.ref_absmax
    noun = "buffer " if r.role == "buffer" else ""
    if ref is not None and math.isfinite(ref) and not r.ref_nonfinite and fmt is not None \
            and fmt.kind == "float" and ref >= fmt.overflow_threshold:
        reason = (f"{noun}{name} holds {ref:.1e} > {fname} max {num_text(fmt.max, grouped=True)}: {what} after the "
                  f"cast to {fname}, before any op ran")
    elif r.ref_nonfinite:
        reason = (f"{noun}{name} is already non-finite in the reference run ({what} in {fname}): the stored "
                  "weights are bad")
    else:
        reason = (f"{noun}{name} holds {what} in {fname} before any op used it (stored non-finite, or it overflowed "
                  f"when the model was cast)")
    return ParameterOrigin(name, call.op, str(r.index), r.dtype, ref, reason, r.role)


def _intended_of(calls: list[_Event]) -> list[Intended]:
    return [Intended(c.op, c.op_type, c.step, c.rank, c.seq, c.intended_count)
            for c in calls if c.intended_out and not c.nf_out]
