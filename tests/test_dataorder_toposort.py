"""The order ``readers.dataorder._toposort`` gives, against the rule it states, written out plainly here."""

import random

import pytest

from precision_lab.readers.dataorder import _toposort


def _by_the_rule(ops, succ, weak):
    """Each step ranks, among the ops whose strong predecessors are all ranked, one that no unranked weak
    predecessor waits on if there is one, the earliest in ``ops`` among those; with none ready (a cycle), the
    earliest unranked op."""
    rank: dict = {}
    while len(rank) < len(ops):
        left = [o for o in ops if o not in rank]
        ready = [o for o in left if all(p in rank for p in ops if o in succ[p])] or left[:1]
        free = [o for o in ready if not any(p not in rank and o in weak[p] - succ[p] for p in ops)]
        rank[(free or ready)[0]] = len(rank)
    return rank


def _graph(rng: random.Random, n: int, acyclic: bool):
    ops = [f"op{i}" for i in range(n)]
    rng.shuffle(ops)
    succ = {o: set() for o in ops}
    weak = {o: set() for o in ops}
    for _ in range(rng.randint(0, 3 * n)):
        a, b = rng.sample(ops, 2) if n > 1 else (ops[0], ops[0])
        if a == b or (acyclic and int(a[2:]) > int(b[2:])):
            continue
        (succ if rng.random() < 0.6 else weak)[a].add(b)
    return ops, succ, weak


@pytest.mark.parametrize("acyclic", [True, False])
def test_the_order_follows_the_stated_rule(acyclic):
    rng = random.Random(7)
    for _ in range(400):
        ops, succ, weak = _graph(rng, rng.randint(1, 24), acyclic)
        assert _toposort(ops, succ, weak) == _by_the_rule(ops, succ, weak)


def test_a_weak_wait_that_ends_while_ready_moves_the_op_forward():
    """c is ready from the start but waits (weakly) on a; once a is ranked it goes before b, which came
    before it in the dump's order."""
    ops = ["a", "b", "c"]
    succ = {"a": set(), "b": set(), "c": set()}
    weak = {"a": {"c"}, "b": set(), "c": set()}
    assert _toposort(["c", "b", "a"], succ, weak) == {"b": 0, "a": 1, "c": 2}
    assert _toposort(ops, succ, weak) == {"a": 0, "b": 1, "c": 2}
    weak = {"a": {"b"}, "b": set(), "c": set()}
    assert _toposort(["b", "a", "c"], succ, weak) == {"a": 0, "b": 1, "c": 2}
