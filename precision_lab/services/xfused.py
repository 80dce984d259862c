"""The pairing's last passes (``xpair``): fused N:1 (a lone node of one run whose output concatenates
consecutive lone nodes of the other), a value held twice by one run, and a fused region recorded at its
boundary against the ops inside it."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .xcalls import (_SAME_DATA_REL, Node, OpCall, OpPair, _confidence, _is_float, _kind, _node_error,
                     _shares_an_input, rel_error)

# calls that compute in one kernel what other code writes as several ops: a fused region's boundary
_FUSED_KERNELS = frozenset({"scaled_dot_product_attention", "layer_norm", "rms_norm", "group_norm", "batch_norm",
                            "softmax", "log_softmax", "linear", "addmm", "gelu", "silu", "cross_entropy"})
# how many nodes after the last pair a fused projection's parts may lie
_FUSE_WINDOW = 12


def _concat_match(cand: Node, run: list[Node]) -> Optional[float]:
    """Relative error of ``cand``'s output against ``run``'s outputs concatenated on the last axis (None: not a
    concatenation of them)."""
    if cand.values is None or any(r.values is None for r in run) or len(run) < 2:
        return None
    if sum(r.numel for r in run) != cand.numel:
        return None
    lasts = [r.values.shape[-1] if r.values.ndim else 1 for r in run]
    lead = {r.numel // d for r, d in zip(run, lasts)}
    if len(lead) != 1:
        return None
    rows = lead.pop()
    ref = np.concatenate([r.values.reshape(rows, d) for r, d in zip(run, lasts)], axis=1)
    return rel_error(ref, cand.values.reshape(rows, -1))


def _same_structure(cand: Node, run: list[Node]) -> bool:
    """Every node of ``run`` computes what ``cand`` computes (the same op type, the same leading shape): fused
    projections whose values moved with their inputs."""
    kinds = {_kind(cand.first)}
    lead = tuple(cand.shape[:-1])
    return all(_kind(a.first) in kinds and tuple(a.shape[:-1]) == lead for a in run)


def _region_start(run: list[Node]) -> OpCall:
    """The first call of a run of nodes that reads floating-point data: a constant made inside a region (a scale
    by ``torch.full``, a table by ``arange``) does not start it."""
    return next((n.first for n in run if any(_is_float(r) for r in n.first.inputs)), run[0].first)


def _starts_from_same_inputs(first: OpCall, region: Sequence[OpCall]) -> bool:
    """Whether one of ``region``'s calls can hold ``first`` and the calls after it: it is a module call or a fused
    kernel, and ``first`` takes one of its inputs (the same values)."""
    for call in region:
        if (call.is_module_call or _kind(call) in _FUSED_KERNELS) and _shares_an_input(first, call):
            return True
    return False


def _within(op: str, module: str) -> bool:
    m = ".".join(op.split(".")[:-2])
    return not module or m == module or m.startswith(module + ".")


def _second_values(pairs: list[OpPair], A: list[Node], B: list[Node], free_a: list[Node],
                   free_b: list[Node]) -> tuple[list[OpPair], list[Node], list[Node]]:
    calls_a = {c.op: (a, c) for a in A if a not in free_a for c in a.calls}
    calls_b = {c.op: (b, c) for b in B if b not in free_b for c in b.calls}
    pair_of = {id(c): p for p in pairs for c in p.ref + p.cand}
    keep_a, keep_b = [], []
    for lone, other, keep, ref_side in ((free_a, calls_b, keep_a, True), (free_b, calls_a, keep_b, False)):
        for n in lone:
            hit = next((other[c.op] for c in n.calls if c.op in other and other[c.op][0].numel == n.numel), None)
            if hit is None:
                keep.append(n)
                continue
            m, call = hit
            a, b = (n, m) if ref_side else (m, n)
            err = _node_error(a, b)
            if err is not None and err > _SAME_DATA_REL:
                # a namesake holding other values is the same datum only as a module boundary whose other run
                # computed less inside it (its output is that of an op inside the module); where the op is
                # outside it, the other run's module holds more (a fused region) and is left to the next pass
                p = pair_of.get(id(call))
                theirs = () if p is None else (p.ref_ops if ref_side else p.cand_ops)
                if not (call.is_module_call and theirs and all(_within(op, call.module) for op in theirs)):
                    keep.append(n)
                    continue
            pairs.append(OpPair(n.calls if ref_side else (call,), (call,) if ref_side else n.calls, "name",
                                _confidence("name", err, True), err, ref_value=a.values, cand_value=b.values))
    return pairs, keep_a, keep_b


def _lone_before(nodes: list[Node], i: int, lone: set) -> list[Node]:
    """The unpaired nodes just before node ``i``, in order."""
    run = []
    k = i - 1
    while k in lone:
        run.insert(0, nodes[k])
        k -= 1
    return run


def _concats(whole: list[Node], parts: list[Node], partner: dict[int, int],
             used: set[int]) -> list[tuple[Node, list[Node], float]]:
    """(node, run, error): each lone node of one run (``whole``) whose output concatenates consecutive lone nodes
    of the other (``parts``, their indices added to ``used``), a few nodes after the pair before it (a fused
    projection runs before the ops that separate its parts in the other run); ``partner``: a paired node's index
    in ``whole``'s run -> its partner's."""
    out = []
    for b in whole:
        lo = max([i for j, i in partner.items() if j < b.idx] + [-1])
        cands = [a for a in parts if lo < a.idx <= lo + _FUSE_WINDOW and a.idx not in used]
        hit = None
        for s in range(len(cands)):
            total = 0
            for e in range(s, len(cands)):
                total += cands[e].numel
                if total > b.numel:
                    break
                if total == b.numel and e > s:
                    run = cands[s:e + 1]
                    err = _concat_match(b, run)
                    if err is not None and (err <= _SAME_DATA_REL or _same_structure(b, run)):
                        hit = (run, err)
                    break
            if hit:
                break
        if hit:
            out.append((b, hit[0], hit[1]))
            used.update(a.idx for a in hit[0])
    return out


def _fused_concats(free_a: list[Node], free_b: list[Node],
                   by_b: dict[int, int]) -> tuple[list[OpPair], set[int], set[int]]:
    """Fused N:1: a lone node of either run whose output concatenates consecutive lone nodes of the other (fused
    qkv against q, k and v projections, whichever run holds the fused one); the pairs, and the indices of the
    nodes they took in each run.  ``by_b``: a paired node's index in the candidate run -> its partner's."""
    by_a = {i: j for j, i in by_b.items()}
    used_a: set[int] = set()
    used_b: set[int] = set()
    out = []
    for whole, parts, partner, used_whole, used_parts, whole_is_ref in (
            (free_b, free_a, by_b, used_b, used_a, False), (free_a, free_b, by_a, used_a, used_b, True)):
        for node, run, err in _concats([n for n in whole if n.idx not in used_whole], parts, partner, used_parts):
            used_whole.add(node.idx)
            rows = run[0].numel // (run[0].values.shape[-1] if run[0].values.ndim else 1)
            cat = np.concatenate([n.values.reshape(rows, -1) for n in run], axis=1)
            run_calls = tuple(c for n in run for c in n.calls)
            own = node.values.reshape(rows, -1)
            ref_calls, cand_calls = (node.calls, run_calls) if whole_is_ref else (run_calls, node.calls)
            ref_v, cand_v = (own, cat) if whole_is_ref else (cat, own)
            out.append(OpPair(ref_calls, cand_calls, "fused N:1", _confidence("fused N:1", err, False), err,
                              concat=True, ref_value=ref_v, cand_value=cand_v))
    return out, used_a, used_b


def _fused_regions(pairs: list[OpPair], A: list[Node], B: list[Node], free_a: list[Node],
                   free_b: list[Node]) -> tuple[list[OpPair], list[Node], list[Node]]:
    """Fused region: lone calls of one side just before a pair, starting from the inputs of the other side's
    call (a compiled region recorded at its boundary against the eager ops inside it, one attention kernel
    against the ops of a written-out attention) join that pair; the pairs, and the nodes still lone."""
    lone_a = {a.idx for a in free_a}
    lone_b = {b.idx for b in free_b}
    pos_a = {id(c): a.idx for a in A for c in a.calls}
    pos_b = {id(c): b.idx for b in B for c in b.calls}
    final = []
    for p in pairs:
        if p.how == "fused N:1":
            final.append(p)
            continue
        run_a = _lone_before(A, pos_a[id(p.ref[0])], lone_a)
        run_b = _lone_before(B, pos_b[id(p.cand[0])], lone_b)
        if run_a and not run_b and _starts_from_same_inputs(_region_start(run_a), p.cand):
            lone_a.difference_update(a.idx for a in run_a)
            p = OpPair(tuple(c for a in run_a for c in a.calls) + p.ref, p.cand, "fused N:1",
                       min(p.confidence, 0.8), p.value_error, ref_value=p.ref_value, cand_value=p.cand_value)
        elif run_b and not run_a and _starts_from_same_inputs(_region_start(run_b), p.ref):
            lone_b.difference_update(b.idx for b in run_b)
            p = OpPair(p.ref, tuple(c for b in run_b for c in b.calls) + p.cand, "fused N:1",
                       min(p.confidence, 0.8), p.value_error, ref_value=p.ref_value, cand_value=p.cand_value)
        final.append(p)
    return final, [a for a in free_a if a.idx in lone_a], [b for b in free_b if b.idx in lone_b]
