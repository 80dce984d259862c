"""``precision-lab capture --recipe NAME``."""

from __future__ import annotations

import pytest
import sys

from typer.testing import CliRunner

from precision_lab.cli import app


@pytest.mark.slow
def test_capture_recipe_names_the_first_nonfinite_op(tmp_path):
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store

    db = tmp_path / "cli.duckdb"
    res = CliRunner().invoke(app, ["capture", "--recipe", "softmax-fp16-overflow", "--db", str(db),
                                   "--session", "sm"])
    assert res.exit_code == 0, res.output
    assert "session 'sm'" in res.output
    assert "first non-finite at attn.softmax.exp.0" in res.output
    store = Store(db)
    runs = store.runs(store.session("sm").session_id)
    assert sorted(runs["kind"]) == ["candidate", "reference"]
    cand = runs[runs["kind"] == "candidate"].iloc[0]
    assert first_nonfinite(store, cand["run_id"]).op == "attn.softmax.exp.0"
    kinds = store.df("SELECT DISTINCT kind FROM comparisons")["kind"].tolist()
    assert sorted(kinds) == ["accumulated", "local"]


@pytest.mark.slow
def test_capture_dtype_and_fix_options(tmp_path):
    db = tmp_path / "cli.duckdb"
    res = CliRunner().invoke(app, ["capture", "--recipe", "softmax-fp16-overflow", "--db", str(db),
                                   "--fix", "stable-softmax", "--no-local"])
    assert res.exit_code == 0, res.output
    assert "candidate (fp16): no NaN/Inf" in res.output
    res = CliRunner().invoke(app, ["capture", "--recipe", "softmax-fp16-overflow", "--db", str(db),
                                   "--dtype", "bf16", "--no-local"])
    assert res.exit_code == 0, res.output
    assert "candidate (bf16)" in res.output


def test_capture_bad_requests_exit_2(tmp_path):
    db = str(tmp_path / "cli.duckdb")
    runner = CliRunner()
    res = runner.invoke(app, ["capture", "--recipe", "no-such-recipe", "--db", db])
    assert res.exit_code == 2 and "unknown recipe 'no-such-recipe'" in res.output
    res = runner.invoke(app, ["capture", "--recipe", "softmax-fp16-overflow", "--dtype", "fp9", "--db", db])
    assert res.exit_code == 2 and "unknown number format 'fp9'" in res.output
    res = runner.invoke(app, ["capture", "--recipe", "softmax-fp16-overflow", "--fix", "no-such-fix", "--db", db])
    assert res.exit_code == 2 and "no-such-fix" in res.output
