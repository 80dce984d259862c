"""Gradients' statistics taken when the step ends instead of in the backward hooks (under DDP: off the
backward's critical path): the same records, seqs and numbers."""

from __future__ import annotations

import pytest
import torch

from precision_lab.live.engine import StatsEngine
from precision_lab.live.options import CaptureOptions
from precision_lab.live.recorder import Capture
from test_capture import build_tiny, loss_fn, tiny_input


def _records(defer: bool, budget=None, steps: int = 2):
    torch.manual_seed(0)
    model = build_tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = Capture(model, run="r", write=False)
    with cap:
        cap._backward.defer = defer
        if budget is not None:
            cap._engine.defer_bytes = budget
        for i in range(steps):
            if i:
                cap.step()
            loss_fn(cap.model(tiny_input(seed=i + 1))).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # the gradients zeroed in place after they were recorded
    return cap


def _summary(cap) -> list:
    return [(r.step, r.seq, r.op, r.role, r.index, r.direction, r.stats) for r in cap.records]


@pytest.mark.parametrize("budget", [None, 4096, 0])
def test_gradient_statistics_taken_at_the_steps_end_are_the_ones_taken_in_the_hooks(budget):
    """The same records, seqs and numbers (histograms included) whether each gradient's statistics are taken in
    its hook or kept and taken when the step ends -- within the memory budget, partly (the rest at once), or not
    at all (a budget of 0)."""
    inline = _records(False)
    deferred = _records(True, budget)
    assert any(r.direction == "backward" for r in inline.records)
    assert _summary(deferred) == _summary(inline)
    assert deferred.warnings == inline.warnings == []


def test_deferred_statistics_wait_for_the_steps_end_within_their_budget():
    warned = []
    eng = StatsEngine(CaptureOptions(), warn=lambda w, m: warned.append(m))
    eng.defer_bytes = 64 * 4
    a, b = torch.randn(64), torch.randn(64)
    ha = eng.measure(a, "x", defer=True)
    hb = eng.measure(b, "x", defer=True)  # past the budget: at once
    view = eng.measure(a.view(8, 8), "x", defer=True)  # a view of a kept tensor takes its statistics
    assert ha.stats is None and hb.stats is not None and view.stats is None
    c = torch.randn(64)
    eng.defer_bytes += 64 * 4
    hc = eng.measure(c, "x", defer=True)
    c.add_(1.0)  # written before the step's end: its statistics are gone, and it says so
    eng.resolve()
    assert ha.stats.max == a.max().item() and view.stats.shape == (8, 8) and view.stats.max == ha.stats.max
    assert hc.stats is None and any("written in place" in m for m in warned)


def _ddp_records(tmp_path, defer: bool, bucket_view: bool):
    """Two captured steps of the tiny model in DDP (a gloo group of one, in this process); the records, and for
    each call of ``resolve_deferred``: whether a backward pass was running and how many statistics waited."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'pg-{defer}'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(build_tiny(), gradient_as_bucket_view=bucket_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cap = Capture(model, run="r", write=False)
        calls = []
        with cap:
            cap._backward.defer = defer
            eng = cap._engine
            resolve = eng.resolve_deferred

            def watched():
                calls.append((torch._C._current_graph_task_id() != -1, len(eng._deferred)))
                resolve()

            eng.resolve_deferred = watched
            for i in range(2):
                if i:
                    cap.step()
                loss_fn(cap.model(tiny_input(seed=i + 1))).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
        return cap, calls
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_under_ddp_gradient_statistics_are_taken_while_the_all_reduce_is_in_flight(tmp_path, bucket_view):
    """Under DDP the gradients' statistics are deferred out of the hooks and taken once the backward has handed
    every gradient over -- inside the backward, before DDP's own callback waits for its all-reduces -- leaving
    nothing for the step's end; the records, seqs and numbers are those taken in the hooks, also where the
    parameters' gradients are views of DDP's buckets (which the all-reduce writes in place)."""
    inline, _ = _ddp_records(tmp_path, False, bucket_view)
    early, calls = _ddp_records(tmp_path, True, bucket_view)
    assert any(r.op_type == "all_reduce" and r.role == "output" for r in early.records)
    assert _summary(early) == _summary(inline)
    assert early.warnings == inline.warnings == []
    during = [n for inside, n in calls if inside]
    after = [n for inside, n in calls if not inside]
    assert len(during) == 2 and all(n > 0 for n in during)  # one per step, with the gradients kept
    assert after and all(n == 0 for n in after)  # the step's end finds none left
