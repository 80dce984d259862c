"""DDP on a GPU: the capture's reading of DDP's gradient all-reduce where the reduction runs on a CUDA stream.

Two ranks share the one GPU of the machine over gloo (gloo reduces CUDA tensors through the host; NCCL refuses
two ranks on one device), and one rank alone runs NCCL, whose all-reduce is asynchronous on its own stream: the
gradient DDP writes back must be read after it lands.  One rank's batch overflows fp16 under CUDA autocast at
step K: the answer names that rank, step K and fc1, and the other rank as receiving it; on a healthy step each
rank's recorded reduction output is the mean of what the ranks held.  Skipped where no GPU exists.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from test_ddp_spread import K, Net, train
from test_multirank import _free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BAD = 1


def _worker(rank: int, world: int, port: int, backend: str, root: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import precision_lab

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(Net().cuda(), device_ids=[0])
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)
        bad = BAD if world > 1 else 0
        with precision_lab.capture(model, run="ddp", shard_dir=root) as cap:
            train(model, opt, cap, g, rank == bad, lambda x: x.cuda(), torch.autocast("cuda", dtype=torch.float16))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _answer(tmp_path, backend: str, world: int):
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import build_report, render_text
    from precision_lab.store import Store

    shards = tmp_path / "shards"
    mp.spawn(_worker, args=(world, _free_port(), backend, str(shards)), nprocs=world, join=True)
    store = Store(tmp_path / "ddp.duckdb")
    name = ingest(shards, store=store)
    return store, render_text(build_report(store, name))


def _reduced_as_the_mean(store, world: int) -> None:
    got = store.sql("SELECT t.rank, t.role, t.mean FROM tensors t WHERE t.step = 0 "
                    "AND t.op = 'module.fc1.all_reduce.0' AND t.\"index\" = 'weight'").fetchall()
    local = {rk: m for rk, role, m in got if role == "input"}
    assert sorted(local) == list(range(world)), got
    outputs = [(rk, m) for rk, role, m in got if role == "output"]
    assert len(outputs) == world, got
    for rk, m in outputs:
        assert m == pytest.approx(sum(local.values()) / world, rel=1e-5, abs=1e-9), (rk, m, local)


def _first(store) -> tuple:
    return store.sql("SELECT t.rank, t.step, t.op FROM tensors t WHERE t.nan_count + t.inf_count > 0 "
                     "ORDER BY t.step, t.seq, t.rank LIMIT 1").fetchone()


def test_two_ranks_on_one_gpu_name_the_rank_that_overflowed(tmp_path):
    store, text = _answer(tmp_path, "gloo", 2)
    rank, step, op = _first(store)
    assert (rank, step) == (BAD, K) and op.startswith("module.fc1."), (rank, step, op)
    assert f"rank {BAD}" in text and "received it" in text and "through the all_reduce" in text, text
    _reduced_as_the_mean(store, 2)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs NCCL")
def test_nccl_all_reduce_is_read_after_it_lands(tmp_path):
    store, text = _answer(tmp_path, "nccl", 1)
    rank, step, op = _first(store)
    assert (rank, step) == (0, K) and op.startswith("module.fc1."), (rank, step, op)
    assert "rank 0" in text, text
    _reduced_as_the_mean(store, 1)
