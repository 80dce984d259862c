"""Four ranks (gloo, CPU) train a DDP model under fp16 autocast; one rank's batch overflows fp16 at step K.  The
answer names that rank, step K and the op, and lists the other ranks as receiving the NaN through the gradient
all-reduce (their own first NaN is a parameter of the next step), not as producers."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from test_multirank import _free_port

pytestmark = pytest.mark.slow  # ranks in their own processes

K, BAD, WORLD, STEPS = 2, 2, 4, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _worker(rank: int, port: int, root: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import precision_lab
    from test_multirank import join_gloo

    dist = join_gloo(rank, WORLD, port)
    try:
        torch.manual_seed(0)
        model = DDP(Net())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)
        with precision_lab.capture(model, run="ddp", shard_dir=root) as cap:
            for step in range(STEPS):
                x = torch.randn(4, 8, generator=g)
                if step == K and rank == BAD:
                    x = x * 1e6  # this rank's batch: fc1's output passes fp16's 65,504
                with torch.autocast("cpu", dtype=torch.float16):
                    y = model(x)
                y.float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                cap.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_rank_that_made_the_nan_is_told_from_those_that_received_it(tmp_path):
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import build_report, render_text
    from precision_lab.store import Store

    port = _free_port()
    shards = tmp_path / "shards"
    mp.spawn(_worker, args=(port, str(shards)), nprocs=WORLD, join=True)
    store = Store(tmp_path / "ddp.duckdb")
    name = ingest(shards, store=store)
    rep = build_report(store, name)
    first = rep["first_nonfinite"]["ddp"]
    assert (first["rank"], first["step"], first["direction"]) == (BAD, K, "forward"), first
    assert first["op"].startswith("module.fc1.")  # the op that overflows: fc1's linear on that rank's batch
    spread = {r["rank"]: r for r in rep["ranks"]["ddp"]}
    assert sorted(spread) == sorted(set(range(WORLD)) - {BAD})
    for r in spread.values():
        # every other rank first holds NaN/Inf in a parameter of the next step: the all-reduced gradient applied
        assert r["state"] == "received" and r["step"] == K + 1 and r["role"] == "param", r
    text = render_text(rep)
    assert f"rank {BAD}" in text and "received it" in text and "all-reduce" in text
    # the dashboard's Overview and the HTML report say it too
    from precision_lab.ui.html_report import render_html
    from precision_lab.ui.overview import first_nonfinite_by_run

    sid = store.session(name)["session_id"]
    (item,) = first_nonfinite_by_run(store, sid)
    assert {r["rank"]: r["state"] for r in item["ranks"]} == {r: "received" for r in spread}
    assert "received it" in render_html(store, name)
