"""A distributed capture's shard folder answered where it lies (``report --shards``), against the same folder
ingested: the same first failure, rank, step and op, the same ranks told apart, the same diagnoses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.readers.shards import write_manifest
from precision_lab.services.ingest import ingest
from precision_lab.services.report import build_report, to_json
from precision_lab.services.shards import ShardError, open_shards
from precision_lab.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import scale_ranks  # noqa: E402  (the scale bench's training run and rank copies, at a small size)

pytestmark = pytest.mark.slow  # two real training captures
runner = CliRunner()
RANKS, BAD_RANK, FAIL_STEP, STEPS = 3, 1, 4, 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as mp:  # nothing of the user's data folder is touched, nor left set after
        mp.setenv("XDG_DATA_HOME", str(tmp / "xdg"))
        mp.setenv("PRECISION_LAB_DB", str(tmp / "default.duckdb"))
        scale_ranks.real_run(tmp / "healthy", 3, STEPS, None)
        scale_ranks.real_run(tmp / "failing", 3, STEPS, FAIL_STEP)  # one block's output passes fp16's 65,504
    out = tmp / "shards"
    for r in range(RANKS):  # the healthy run's files stand for the other ranks
        scale_ranks.as_rank(tmp / ("failing" if r == BAD_RANK else "healthy"), out, r)
    write_manifest(out, [json.loads((tmp / "healthy" / "manifest.json").read_text())["runs"][0]])
    return out


def _strip(doc):
    """A report without what differs by construction (ids, record ids, the session's and runs' sources)."""
    drop = {"run_id", "rid", "session", "created", "source", "notes", "ref_rid", "cand_rid", "session_id",
            "order_note"}
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in drop}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def test_in_place_answers_as_ingest_does(shards, tmp_path):
    store, name = open_shards(shards)
    here = json.loads(to_json(build_report(store, name)))
    db = Store(str(tmp_path / "x.duckdb"))
    there = json.loads(to_json(build_report(db, ingest(shards, store=db))))
    first = here["first_nonfinite"]["train"]
    assert (first["step"], first["rank"], first["certainty"]) == (FAIL_STEP, BAD_RANK, "certain")
    assert first["op"].startswith("0.0")  # the first block's output overflowed
    for key in ("first_nonfinite", "ranks", "diagnoses", "tensors", "timeline", "alerts", "intended_nonfinite"):
        assert _strip(here[key]) == _strip(there[key]), key
    # every other rank is told apart from the producing one
    assert {s["rank"] for s in here["ranks"]["train"]} == set(range(RANKS)) - {BAD_RANK}


def test_the_cli_reports_a_shard_folder_without_a_database(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("PRECISION_LAB_DB", str(tmp_path / "never.duckdb"))
    res = runner.invoke(app, ["report", "--shards", str(shards)])
    assert res.exit_code == 0, res.output
    assert f"(step {FAIL_STEP}, rank {BAD_RANK}" in res.output
    assert not (tmp_path / "never.duckdb").exists()  # nothing was ingested anywhere


def test_a_session_or_a_shard_folder_not_both(shards):
    for args in (["report"], ["report", "--shards", str(shards), "--session", "x"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "one of them" in res.output


def test_a_damaged_shard_is_named_in_one_sentence(shards, tmp_path):
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(shards, bad)
    victim = sorted((bad / "train" / f"rank{BAD_RANK}").glob("step*.parquet"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] + b"\0" * 64 + data[-8:])  # the footer kept, the pages broken
    res = runner.invoke(app, ["report", "--shards", str(bad)])
    assert res.exit_code == 2, res.output
    assert victim.name in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_linked_shard_is_refused(shards, tmp_path):
    import shutil

    bad = tmp_path / "linked"
    shutil.copytree(shards, bad)
    victim = sorted((bad / "train" / "rank0").glob("step*.parquet"))[0]
    victim.unlink()
    victim.symlink_to(sorted((shards / "train" / "rank0").glob("step*.parquet"))[0])
    with pytest.raises(ShardError, match=victim.name):
        open_shards(bad)


def test_the_store_reads_the_shards_it_was_given_and_nothing_else(shards, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    store, _ = open_shards(shards)
    for q in (f"SELECT * FROM read_text('{secret}')", f"SELECT * FROM read_parquet('{other}')",
              f"SELECT * FROM read_parquet('{shards}/*/rank*/*.parquet')", "SET enable_external_access = true"):
        with pytest.raises(Exception):
            store.sql(q).fetchall()
