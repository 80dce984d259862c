"""The ``ingest``, ``report`` and ``compare`` commands, through typer's runner."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.cli._conditions import Condition, parse_condition
from precision_lab.services.report import Report, ReportComparison

from conftest import FIXTURES

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.slow
def test_ingest_prints_the_session_name_and_report_reads_it(tmp_path):
    db = tmp_path / "cli.duckdb"
    r = _run("ingest", FIXTURES / "stat_mix_fp16_inner_ovf", "--reference", FIXTURES / "stat_mix_fp32_inner_ovf",
             "--db", db, "--session", "ovf")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "ovf"
    r = _run("report", "--session", "ovf", "--db", db)
    assert r.exit_code == 0, r.output
    assert "stat_mix_fp16_inner_ovf: Functional.linear.10.forward" in r.stdout
    assert "fp16 norm-arithmetic artefact" in r.stdout
    r = _run("report", "--session", "ovf", "--db", db, "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["session"] == "ovf"
    assert doc["first_nonfinite"]["stat_mix_fp16_inner_ovf"]["op"] == "Functional.linear.10.forward"


@pytest.mark.slow
def test_ingest_default_db_and_name(tmp_path, monkeypatch):
    r = _run("ingest", FIXTURES / "tensor_mix_fp32")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "tensor_mix_fp32"
    r = _run("ingest", FIXTURES / "tensor_mix_fp32")
    assert r.stdout.strip() == "tensor_mix_fp32-2"  # names stay unique


def test_report_unknown_session_exits_2(tmp_path):
    r = _run("report", "--session", "nope", "--db", tmp_path / "x.duckdb")
    assert r.exit_code == 2
    assert "no session named 'nope'" in r.output


def test_ingest_bad_input_exits_2_naming_the_file(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "t.npy").write_bytes(b"\x93NUMPY garbage")
    r = _run("ingest", d, "--db", tmp_path / "x.duckdb")
    assert r.exit_code == 2
    assert "t.npy" in r.output and "error:" in r.output


@pytest.mark.slow
def test_compare_fail_on_nonfinite():
    r = _run("compare", FIXTURES / "stat_mix_fp32_inner_ovf", FIXTURES / "stat_mix_fp16_inner_ovf",
             "--fail-on", "nonfinite")
    assert r.exit_code == 1, r.output
    assert "FAIL nonfinite" in r.output
    r = _run("compare", FIXTURES / "tensor_mix_fp32", FIXTURES / "tensor_mix_fp16", "--fail-on", "nonfinite")
    assert r.exit_code == 0, r.output
    assert "did not trip" in r.output


def _pair(tmp_path, nan: bool):
    g = torch.Generator().manual_seed(3)
    ref, cand = tmp_path / f"ref{nan}", tmp_path / f"cand{nan}"
    ref.mkdir()
    cand.mkdir()
    x = torch.randn(32, 16, generator=g)
    for k, v in {"lin.output.0": x, "act.output.0": torch.tanh(x)}.items():
        np.save(ref / f"{k}.npy", v.numpy())
        c = v.half().numpy()
        if nan and k == "act.output.0":
            c[0, 0] = np.nan
        np.save(cand / f"{k}.npy", c)
    return ref, cand


def test_compare_generic_nan_and_clean(tmp_path):
    ref, cand = _pair(tmp_path, nan=True)
    r = _run("compare", ref, cand, "--fail-on", "nonfinite")
    assert r.exit_code == 1 and "act output 0" in r.output
    ref, cand = _pair(tmp_path, nan=False)
    assert _run("compare", ref, cand, "--fail-on", "nonfinite").exit_code == 0


def test_an_error_gate_fails_on_a_nan_output_whatever_the_finite_values_say(tmp_path):
    """One NaN where the reference is finite: the SQNR over the finite values stays high, but no error bound holds
    for that output, so ``sqnr<`` and ``max_rel_err>`` trip with any threshold."""
    ref, cand = _pair(tmp_path, nan=True)
    rep = json.loads(_run("compare", ref, cand, "--json").stdout)
    act = next(c for c in rep["comparisons"] if c["op"] == "act" and c["role"] == "output")
    assert act["nonfinite_introduced"] == 1 and (act["sqnr_db"] is None or act["sqnr_db"] > 20)
    for cond in ("sqnr<-1000", "max_rel_err>1e30"):
        r = _run("compare", ref, cand, "--fail-on", cond)
        assert r.exit_code == 1 and "non-finite in the candidate but not the reference" in r.output, (cond, r.output)
    ref, cand = _pair(tmp_path, nan=False)
    assert _run("compare", ref, cand, "--fail-on", "sqnr<-1000").exit_code == 0


def test_compare_sqnr_and_rel_err_thresholds(tmp_path):
    ref, cand = _pair(tmp_path, nan=False)
    x = np.load(ref / "lin.output.0.npy").astype(np.float64)
    c = np.load(cand / "lin.output.0.npy").astype(np.float64)
    sqnr = 10 * np.log10(np.sum(x * x) / np.sum((c - x) ** 2))
    assert _run("compare", ref, cand, "--fail-on", f"sqnr<{sqnr - 5:.3f}").exit_code == 0
    r = _run("compare", ref, cand, "--fail-on", f"sqnr<{sqnr + 5:.3f}")
    assert r.exit_code == 1 and "FAIL sqnr<" in r.output
    r = _run("compare", ref, cand, "--fail-on", "max_rel_err>1e-9")
    assert r.exit_code == 1 and "(element-wise)" in r.output and "summary" not in r.output
    assert _run("compare", ref, cand, "--fail-on", "max_rel_err>10").exit_code == 0


def test_rel_err_threshold_on_statistics_only_dumps_uses_the_summaries(tmp_path):
    """Statistics-only dumps have no element-wise error: ``max_rel_err>X`` is checked on the summaries'
    relative error (summary_rel_err), and the message says so."""
    ref, cand = FIXTURES / "stat_mix_fp32_inner_ovf", FIXTURES / "stat_mix_fp16_inner_ovf"
    rep = json.loads(_run("compare", ref, cand, "--json").stdout)
    judged = [c for c in rep["comparisons"] if c["verdict"] is not None]
    assert judged and all(c["max_rel_err"] is None for c in judged)
    worst = max(c["summary_rel_err"] for c in judged if isinstance(c["summary_rel_err"], float))
    r = _run("compare", ref, cand, "--fail-on", f"max_rel_err>{worst / 2:.6g}")
    assert r.exit_code == 1 and "(on summary statistics)" in r.output and "element-wise" not in r.output
    # above every finite error, the gate still trips on what overflowed in the candidate alone
    r = _run("compare", ref, cand, "--fail-on", f"max_rel_err>{worst * 2:.6g}")
    assert r.exit_code == 1 and "(on summary statistics)" not in r.output
    assert "non-finite in the candidate but not the reference" in r.output


def test_rel_err_condition_names_an_element_wise_error_before_a_summary_one():
    from precision_lab.cli._conditions import check_conditions

    def cmp(op, basis, rel):
        return ReportComparison(**{**dict.fromkeys(f.name for f in dataclasses.fields(ReportComparison)),
                                   "kind": "accumulated", "op": op, "role": "output", "index": "0", "basis": basis,
                                   "verdict": "warn", "max_rel_err": rel if basis == "tensor" else None,
                                   "summary_rel_err": rel if basis == "stats" else None})

    rep = Report(**{**dict.fromkeys(f.name for f in dataclasses.fields(Report)), "runs": [], "tensors": [],
                    "comparisons": [cmp("a", "tensor", 0.5), cmp("b", "stats", 3.0), cmp("c", "tensor", 0.01)]})
    tripped, unusable = check_conditions(rep, [Condition("max_rel_err", 0.1)])
    assert not unusable and len(tripped) == 1
    assert "2 tensor(s) (1 element-wise, 1 on summary statistics)" in tripped[0]
    assert "worst a output 0 at 0.5 (element-wise)" in tripped[0]
    tripped, _ = check_conditions(rep, [Condition("max_rel_err", 1.0)])
    assert tripped == ["max_rel_err>1: 1 tensor(s) (1 on summary statistics), worst b output 0 at 3 "
                       "(on summary statistics)"]


def test_compare_unusable_input_exits_2(tmp_path):
    r = _run("compare", tmp_path / "missing", FIXTURES / "tensor_mix_fp16")
    assert r.exit_code == 2 and "no such file or folder" in r.output
    # statistics-only dumps cannot answer an SQNR condition
    r = _run("compare", FIXTURES / "stat_mix_fp32_inner_ovf", FIXTURES / "stat_mix_fp32_inner_ovf",
             "--fail-on", "sqnr<30")
    assert r.exit_code == 2 and "no element-wise comparisons" in r.output
    r = _run("compare", FIXTURES / "tensor_mix_fp32", FIXTURES / "tensor_mix_fp16", "--fail-on", "sqnr>3")
    assert r.exit_code == 2 and "expected nonfinite" in r.output


@pytest.mark.slow
def test_compare_keeps_the_session_only_with_db(tmp_path):
    db = tmp_path / "ci.duckdb"
    r = _run("compare", FIXTURES / "tensor_mix_fp32", FIXTURES / "tensor_mix_fp16", "--db", db, "--session", "ci",
             "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["session"] == "ci"
    assert _run("report", "--session", "ci", "--db", db).exit_code == 0


@pytest.mark.parametrize("text,cond", [("nonfinite", Condition("nonfinite")), ("sqnr<30", Condition("sqnr", 30.0)),
                                       ("max_rel_err>0.01", Condition("max_rel_err", 0.01)),
                                       (" sqnr < 12.5 ", Condition("sqnr", 12.5))])
def test_parse_condition(text, cond):
    assert parse_condition(text) == cond
