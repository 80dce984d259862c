"""Four ranks (gloo, CPU) train a model in fp16; one rank's batch overflows fp16 at step K.  The answer names that
rank, step K and the op, and lists the other ranks as receiving the NaN, not as producers:

- DDP under fp16 autocast: they receive it in the same step through DDP's gradient all-reduce, recorded as an
  op per parameter (the gradient as accumulated on the rank, and as DDP wrote the average back);
- FSDP2 (``fully_shard``) whose mixed-precision policy computes in fp16 (FSDP's own casts; autocast with FSDP2 on
  CPU aborts torch 2.13 with no capture at all): the overflow is FSDP's cast of that rank's batch, and the others
  receive it in the same step, in their shard of a weight gradient, through the gradients' reduce-scatter.  The
  capture runs no collective of its own (a rank's statistics of a sharded tensor are of its own shard), and FSDP's
  plumbing (the all-gather buffer it fills) is no op of the run;
- a tensor-parallel layer in fp16 whose partial results are summed with ``dist.all_reduce`` inside the forward:
  the collective is recorded as an op on every rank (what each sent, what it got back), and the others receive
  the overflow through it in the same step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from test_multirank import _free_port

pytestmark = pytest.mark.slow  # ranks in their own processes

K, BAD, WORLD, STEPS = 2, 2, 4, 4
TENSOR_PARALLEL = ("tp", "async", "funcol", "dtensor")  # fp16 models whose forward sums partial results over the ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class RowParallel(Net):
    """fc2's partial sums added over the ranks, as a row-parallel linear does (each rank's own batch here)."""

    def forward(self, x):
        import torch.distributed as dist

        p = self.fc2(torch.relu(self.fc1(x)))
        dist.all_reduce(p)
        return p


class RowParallelAsync(Net):
    """The same sum, started with ``async_op=True`` and waited for before use (overlapping the collective)."""

    def forward(self, x):
        import torch.distributed as dist

        p = self.fc2(torch.relu(self.fc1(x)))
        dist.all_reduce(p, async_op=True).wait()
        return p * 1.0


class RowParallelFunctional(Net):
    """The same sum through a functional collective (``_functional_collectives.all_reduce``, as DTensor and
    torch.compile call them): it returns before the sum is written, and the result is waited for on use."""

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        p = self.fc2(torch.relu(self.fc1(x)))
        return funcol.all_reduce(p, "sum", dist.group.WORLD) * 1.0


def _model(kind: str):
    if kind == "tp":
        return RowParallel().half()
    if kind == "async":
        return RowParallelAsync().half()
    if kind == "funcol":
        return RowParallelFunctional().half()
    if kind == "dtensor":
        # tensor parallelism as torchtitan does it: fc1 split by columns, fc2 by rows, fc2's partial outputs
        # summed by DTensor's redistribution (a functional all-reduce)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(Net().half(), init_device_mesh("cpu", (WORLD,)),
                                  {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(Net())
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for m in (model.fc1, model.fc2, model):
        fully_shard(m, mp_policy=policy)
    return model


def train(model, opt, cap, g, bad: bool, to_device, autocast) -> None:
    """STEPS captured training steps of ``model`` on batches drawn from ``g``; when ``bad``, step K's batch is
    scaled by 1e6 (fc1's output, or its cast to fp16, passes 65,504)."""
    for step in range(STEPS):
        x = to_device(torch.randn(4, 8, generator=g))
        if step == K and bad:
            x = x * 1e6
        with autocast:
            y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cap.step()


def _worker(rank: int, port: int, root: str, kinds: tuple) -> None:
    """One rank: a captured run of each kind, one after the other (its own model and capture each)."""
    import precision_lab
    from test_multirank import join_gloo

    dist = join_gloo(rank, WORLD, port)
    try:
        for kind in kinds:
            torch.manual_seed(0)
            model = _model(kind)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(100 + rank)
            with precision_lab.capture(model, run=kind, shard_dir=root) as cap:
                dtype = torch.float16 if kind in TENSOR_PARALLEL else torch.float32
                train(model, opt, cap, g, rank == BAD, lambda x: x.to(dtype),
                      torch.autocast("cpu", dtype=torch.float16) if kind == "ddp" else contextlib.nullcontext())
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _report(tmp_path, *kinds: str):
    """The ranks' runs of these kinds (in one start of the ranks), ingested as one session, and its report."""
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import build_report
    from precision_lab.store import Store

    port = _free_port()
    shards = tmp_path / "shards"
    mp.spawn(_worker, args=(port, str(shards), kinds), nprocs=WORLD, join=True)
    store = Store(tmp_path / "ranks.duckdb")
    name = ingest(shards, store=store)
    return store, name, build_report(store, name)


def test_the_rank_that_made_the_nan_is_told_from_those_that_received_it(tmp_path):
    from precision_lab.services.report import render_text

    store, name, rep = _report(tmp_path, "ddp")
    first = rep.first_nonfinite["ddp"]
    assert (first.rank, first.step, first.direction) == (BAD, K, "forward"), first
    assert first.op.startswith("module.fc1.")  # the op that overflows: fc1's linear on that rank's batch
    spread = {r.rank: r for r in rep.ranks["ddp"]}
    assert sorted(spread) == sorted(set(range(WORLD)) - {BAD})
    for r in spread.values():
        # every other rank first holds NaN/Inf in what DDP's all-reduce wrote back into a gradient of step K
        assert (r.state, r.step, r.role) == ("received", K, "output"), r
        assert r.op.startswith("module.fc") and r.op.endswith(".all_reduce.0"), r
    text = render_text(rep)
    assert f"rank {BAD}" in text and "received it" in text and "through the all_reduce" in text
    # the recorded reduction is DDP's: on a healthy step each rank gets back the average of what the ranks had
    got = store.sql("SELECT t.rank, t.role, t.mean FROM tensors t JOIN runs r USING (run_id) WHERE r.name = 'ddp' "
                    "AND t.step = 0 AND t.op = 'module.fc1.all_reduce.0' AND t.\"index\" = 'weight'").fetchall()
    local = {rk: m for rk, role, m in got if role == "input"}
    assert sorted(local) == list(range(WORLD))
    for rk, role, m in got:
        if role == "output":
            assert m == pytest.approx(sum(local.values()) / WORLD, rel=1e-5, abs=1e-9), (rk, m, local)
    # the dashboard's Overview and the HTML report say it too
    from precision_lab.ui.html_report import render_html
    from precision_lab.ui.overview import first_nonfinite_by_run

    sid = store.session(name).session_id
    (item,) = first_nonfinite_by_run(store, sid)
    assert {r.rank: r.state for r in item.ranks} == {r: "received" for r in spread}
    assert "received it" in render_html(store, name)


def test_fsdp_the_rank_that_made_the_nan_is_told_from_those_that_received_it(tmp_path):
    from precision_lab.services.report import render_text

    store, name, rep = _report(tmp_path, "fsdp")
    first = rep.first_nonfinite["fsdp"]
    assert (first.rank, first.step, first.direction) == (BAD, K, "forward"), first
    # FSDP's cast of that rank's batch to fp16 is the first value past 65,504; fc1 reads it (first NaN there)
    assert (first.op_type, first.role, first.certainty) == ("to", "output", "certain"), first
    assert first.first_nan.op == "fc1.linear.0" and first.first_nan.rank == BAD
    spread = {r.rank: r for r in rep.ranks["fsdp"]}
    assert sorted(spread) == sorted(set(range(WORLD)) - {BAD})
    for r in spread.values():
        # each other rank first holds it in its shard of a weight gradient of the same step: not a value it made
        assert (r.state, r.step, r.role) == ("received", K, "param_grad"), r
    text = render_text(rep)
    assert f"rank {BAD}" in text and "received it" in text and "reduce-scatter" in text
    ops = {row[0] for row in store.sql("SELECT DISTINCT op_type FROM tensors").fetchall()}
    assert "all_gather_copy_in" not in ops and "linear" in ops


def test_a_collective_in_the_forward_is_an_op_and_its_receivers_are_named(tmp_path):
    """``dist.all_reduce``, also with ``async_op=True`` and a wait; a functional all-reduce, whose result lands
    after the call returns (its record is of what landed); DTensor's row-parallel linear, which calls one (named
    in the module that calls it).  One run of each on the same four ranks."""
    from precision_lab.services.report import render_text

    store, name, rep = _report(tmp_path, *TENSOR_PARALLEL)
    text = render_text(rep)
    for kind in TENSOR_PARALLEL:
        _check_tensor_parallel(store, rep, text, kind)
    ops = {row[0] for row in store.sql("SELECT DISTINCT op_type FROM tensors").fetchall()}
    assert not ops & {"wait_tensor", "wrap_tensor_autograd"}  # waiting for a result moves no value


def _check_tensor_parallel(store, rep, text: str, kind: str) -> None:
    op = "fc2.all_reduce.0" if kind == "dtensor" else "all_reduce.0"
    first = rep.first_nonfinite[kind]
    assert (first.rank, first.step, first.direction) == (BAD, K, "forward"), (kind, first)
    assert first.op.startswith("fc1."), (kind, first)  # fc1's fp16 output on that rank's batch passes 65,504
    spread = {r.rank: r for r in rep.ranks[kind]}
    assert sorted(spread) == sorted(set(range(WORLD)) - {BAD}), kind
    for r in spread.values():
        assert (r.state, r.step, r.op) == ("received", K, op), (kind, r)
        assert "through the all_reduce" in r.text, kind
    assert "through the all_reduce" in text
    # the collective's records on every rank: what it sent and what it got back, the sum of what all sent
    rows = store.sql("SELECT t.rank, t.step, t.role, t.numel, t.mean, t.nan_count + t.inf_count AS bad "
                     "FROM tensors t JOIN runs r USING (run_id) WHERE r.name = ? AND t.op = ?", [kind, op]
                     ).fetchall()
    by = {(rk, st, role): (numel, mean, bad) for rk, st, role, numel, mean, bad in rows}
    assert {k[0] for k in by} == set(range(WORLD)), kind
    sent = sum(by[(rk, 0, "input")][1] for rk in range(WORLD))
    for rk in range(WORLD):
        assert by[(rk, 0, "output")][1] == pytest.approx(sent, rel=2e-3, abs=2e-3), (kind, rk)  # fp16 sums
        if rk != BAD:
            assert by[(rk, K, "input")][2] == 0 and by[(rk, K, "output")][2] > 0, (kind, rk)
