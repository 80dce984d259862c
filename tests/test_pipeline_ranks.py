"""Two pipeline stages on two gloo ranks: rank 0 runs fc1 in fp16 and sends its activation to rank 1, which runs
fc2 on what it received.  Rank 0's batch at step K passes 65,504: the answer names rank 0, step K and fc1, and rank
1 as receiving the value through the receive it records -- with ``batch_isend_irecv``, with ``isend``/``irecv``
(``torch.distributed.pipelining`` calls both) and with plain ``send``/``recv``."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from test_multirank import _free_port

pytestmark = pytest.mark.slow  # ranks in their own processes

K, STEPS = 1, 3


class Stage(nn.Module):
    def __init__(self, first: bool, kind: str):
        super().__init__()
        self.first, self.kind = first, kind
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if self.first:
            y = self.fc(x)
            _transfer(self.kind, y, 1, receive=False)
            return y
        buf = torch.empty(4, 8, dtype=torch.float16)
        _transfer(self.kind, buf, 0, receive=True)
        return self.fc(torch.relu(buf))


def _transfer(kind: str, t, peer: int, *, receive: bool) -> None:
    """Send ``t`` to ``peer`` or receive it from there: batched, as isend/irecv, or as send/recv."""
    import torch.distributed as dist

    if kind == "batch":
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv if receive else dist.isend, t, peer)]):
            w.wait()
    elif kind == "direct":
        (dist.irecv if receive else dist.isend)(t, peer).wait()
    else:
        (dist.recv if receive else dist.send)(t, peer)


KINDS = ("batch", "direct", "plain")


def _worker(rank: int, port: int, root: str) -> None:
    """One stage: a captured run of each way of sending, one after the other."""
    import precision_lab
    from test_multirank import join_gloo

    dist = join_gloo(rank, 2, port)
    try:
        for kind in KINDS:
            torch.manual_seed(rank)
            model = Stage(rank == 0, kind).half()
            g = torch.Generator().manual_seed(7)
            with precision_lab.capture(model, run=kind, shard_dir=root) as cap:
                for step in range(STEPS):
                    x = torch.randn(4, 8, generator=g)
                    if step == K:
                        x = x * 1e6
                    with torch.no_grad():
                        model(x.half())
                    cap.step()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_stage_that_receives_the_overflow_is_named_as_receiving_it(tmp_path):
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import build_report, render_text
    from precision_lab.store import Store

    shards = tmp_path / "shards"
    mp.spawn(_worker, args=(_free_port(), str(shards)), nprocs=2, join=True)
    store = Store(tmp_path / "pp.duckdb")
    rep = build_report(store, ingest(shards, store=store))
    assert "through the recv" in render_text(rep)
    for kind in KINDS:
        first = rep.first_nonfinite[kind]
        assert (first.rank, first.step, first.op) == (0, K, "fc.linear.0"), (kind, first)
        (other,) = rep.ranks[kind]
        assert (other.rank, other.state, other.step, other.op) == (1, "received", K, "recv.0"), (kind, other)
        # what rank 1 received is what rank 0 sent, on a healthy step too
        rows = store.sql("SELECT t.rank, t.role, t.max, t.min, t.mean FROM tensors t JOIN runs r USING (run_id) "
                         "WHERE r.name = ? AND t.step = 0 AND t.op IN ('send.0', 'recv.0')", [kind]).fetchall()
        got = {(rk, role): (mx, mn, mean) for rk, role, mx, mn, mean in rows}
        assert set(got) == {(0, "input"), (1, "output")}, kind
        assert got[(0, "input")] == got[(1, "output")], kind
