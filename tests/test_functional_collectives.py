"""Functional collectives (``torch.distributed._functional_collectives``, what DTensor and torch.compile call)
recorded as ops: a call returns before its output is written, so the capture waits for it before reading it;
waiting and wrapping the result for autograd move no value and are no ops.  In this process, as a gloo group of
one (the ranks' test is ``test_ddp_spread``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from precision_lab.live.naming import _func_info
from precision_lab.live.recorder import Capture


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_functional_collectives_are_ops_that_wait_and_their_plumbing_is_none():
    import torch.distributed._functional_collectives  # noqa: F401  (registers the wrapping op)

    ops = torch.ops._c10d_functional
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                 "broadcast"):
        info = _func_info(getattr(ops, name))
        assert (info.name, info.skip, info.waits) == (name, False, "_c10d_functional")
    assert _func_info(ops.wait_tensor).skip and _func_info(ops._wrap_tensor_autograd).skip
    assert _func_info(torch.add).waits is None
    # torch.distributed's own functions reach the function mode (recv, send) but are recorded by the capture's
    # collective and point-to-point wrappers, as the calls that move data
    assert _func_info(dist.recv).skip and _func_info(dist.send).skip


def test_a_functional_all_reduce_is_recorded_once_it_has_landed(group):
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import _get_work_registry_size

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = funcol.all_reduce(self.fc(x), "sum", group)
            self.pending = _get_work_registry_size()  # the capture has waited for the collective already
            return y * 2

    torch.manual_seed(0)
    m = M()
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = (m.fc(x) * 1.0).double().numpy()
    cap = Capture(m, run="r", write=False)
    with cap:
        out = m(x)
    assert m.pending == 0
    recs = {(r.op, r.role): r for r in cap.records}
    assert {op for op, _ in recs} >= {"all_reduce.0", "mul.0"}
    assert not {r.op_type for r in cap.records} & {"wait_tensor", "wrap_tensor_autograd"}
    got = recs[("all_reduce.0", "output")].stats
    assert recs[("all_reduce.0", "output")].op_type == "all_reduce"
    assert (got.max, got.min, got.numel) == (want.max(), want.min(), 12)
    assert got.mean == pytest.approx(want.mean(), rel=1e-12)
    assert torch.equal(out, torch.from_numpy(want).float() * 2)
    assert cap.warnings == []


def test_an_async_collective_is_recorded_once_its_work_has_completed(group):
    """``dist.all_reduce(y, async_op=True)``: what was sent is recorded at the call, what came back once the work
    has completed, where ``y`` is next read.  A collective writes ``y`` without a new version; the write is
    stood in for here by one through ``y.data`` after the wait (a group of one sums nothing), and neither the
    collective's output nor the op that reads ``y`` after it may keep the statistics taken before, and the output
    is what that op read, not what it left."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            work = dist.all_reduce(y, async_op=True, group=group)
            work.wait()
            y.data.mul_(3.0)  # what the other ranks' values would have made of it
            return y.add_(1.0)  # read, then written: the collective's output is what was read

    torch.manual_seed(0)
    m = M()
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = m.fc(x).double().numpy()
    cap = Capture(m, run="r", write=False)
    with cap:
        m(x)
    recs = {(r.op, r.role): r for r in cap.records}
    sent, got, read = recs[("all_reduce.0", "input")], recs[("all_reduce.0", "output")], recs[("add_.0", "input")]
    assert sent.seq == got.seq and sent.op_type == got.op_type == "all_reduce"
    assert (sent.stats.max, sent.stats.min) == (before.max(), before.min())
    after = (torch.from_numpy(before).float() * 3.0).double().numpy()
    for r in (got, read):
        assert (r.stats.max, r.stats.min) == (after.max(), after.min())
        assert r.stats.mean == pytest.approx(after.mean(), rel=1e-12)
    assert cap.warnings == []


def test_an_async_collective_still_running_at_the_steps_end_is_counted(group):
    class Never:
        def is_completed(self):
            return False

    m = torch.nn.Linear(4, 4)
    cap = Capture(m, run="r", write=False)
    with cap:
        y = m(torch.randn(2, 4))
        ctx = cap.collective_before("all_reduce", y)
        cap.collective_after(ctx, y, Never())
    roles = [(r.op, r.role) for r in cap.records if r.op_type == "all_reduce"]
    assert roles == [("all_reduce.0", "input")]
    assert any("async_op=True: what they got back is not recorded" in m for _, m in cap.warnings)


def test_an_async_output_written_over_before_it_is_seen_complete_is_counted_not_recorded(group):
    """Where the work is first seen completed only after the step wrote the tensor in place (a device collective
    read at the step's end), what the collective wrote is gone: no output record, and the run says so."""

    class Later:
        done = False

        def is_completed(self):
            return self.done

    m = torch.nn.Linear(4, 4)
    work = Later()
    cap = Capture(m, run="r", write=False)
    with cap:
        y = m(torch.randn(2, 4))
        ctx = cap.collective_before("all_reduce", y)
        cap.collective_after(ctx, y, work)
        z = y.add_(1.0)  # read while running, then written
        work.done = True
        z * 2.0
    assert [r.role for r in cap.records if r.op_type == "all_reduce"] == ["input"]
    assert any("async_op=True: what they got back is not recorded" in m for _, m in cap.warnings)
