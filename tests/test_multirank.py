"""Two ranks (gloo, CPU) capture to their own shards; rank 1's input overflows fp16 in its first layer."""

from __future__ import annotations

import os
import socket

import duckdb
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from precision_lab.readers.shards import read_manifest, read_shards, shard_glob

pytestmark = pytest.mark.slow  # ranks in their own processes


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc1.weight.fill_(0.5)
            self.fc1.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int):
    """This process as ``rank`` of a gloo group of ``world`` on localhost ``port`` (one torch thread each: the
    ranks share the machine's cores); returns ``torch.distributed``."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dist


def _worker(rank: int, world: int, port: int, root: str) -> None:
    from precision_lab import capture

    dist = join_gloo(rank, world, port)
    try:
        torch.manual_seed(0)
        model = TwoLayer().half()
        # every value in [0.75, 1.25] * scale: finite in fp16 either way; on rank 1 each row of
        # fc1 sums to at least 8 * 0.5 * 2.25e4 = 9e4, above fp16's max finite value
        x = (torch.rand(2, 8) * 0.5 + 0.75) * (3e4 if rank == 1 else 1.0)
        with capture(model, run="fp16", shard_dir=root) as cap:
            for _ in range(2):
                y = cap.model(cap.prepare_inputs(x.half()))
                loss = y.float().sum()
                dist.all_reduce(loss)  # a real collective between the ranks
                cap.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_shards_and_rank1_is_the_first_nonfinite_producer(tmp_path, store):
    from precision_lab.services.report import first_nonfinite

    root = tmp_path / "job"
    mp.spawn(_worker, args=(2, _free_port(), str(root)), nprocs=2, join=True)
    run = read_manifest(root)["runs"][0]
    assert run["ranks"] == [0, 1] and run["steps"] == [0, 1]
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet")) == [
        "fp16/rank0/step0.parquet", "fp16/rank0/step1.parquet", "fp16/rank1/step0.parquet",
        "fp16/rank1/step1.parquet"]
    # DuckDB over the glob
    rows = duckdb.connect().execute(
        f"SELECT rank, step, op, role FROM read_parquet('{shard_glob(root)}') WHERE nonfinite "
        "ORDER BY step, seq, rank").fetchall()
    # rank 1 made them, first at fc1's linear; rank 0 holds only what the loss's all-reduce handed it, recorded
    # as that collective's output (its input, rank 0's own loss, is finite)
    assert rows and [r[2:] for r in rows if r[0] == 1][0] == ("fc1.linear.0", "output")
    assert {r[2:] for r in rows if r[0] == 0} == {("all_reduce.0", "output")}
    # into a store, the report names rank 1 and the op
    records = list(read_shards(root))
    meta = records[0][0]
    assert len({m["run_id"] for m, _ in records}) == 1  # both ranks named the run alike
    with store.new_session("multirank", source=str(root)) as w:
        run_id = w.add_run(run_id=meta["run_id"], name=meta["name"], dtype=meta["dtype"], kind=meta["kind"])
        for _, rec in records:
            w.add_record(rec)
    hit = first_nonfinite(store, run_id)
    assert hit.producer and hit.rank == 1 and hit.op == "fc1.linear.0" and hit.step == 0
