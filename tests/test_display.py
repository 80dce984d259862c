"""One way to write a number, wherever it is shown."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.display import MISSING, num_text
from precision_lab.fixes.rules import fmt_num
from precision_lab.ui.common import num_text as table_text


def test_fp16_max_nan_and_missing_read_the_same_everywhere():
    fp16_max = float(ml_dtypes.finfo(np.float16).max)  # 65504, from the dtype itself
    assert num_text(fp16_max) == table_text(fp16_max) == str(int(fp16_max))
    assert fmt_num(fp16_max) == f"{int(fp16_max):,}"  # prose groups thousands: 65,504
    for shown in (num_text, table_text, fmt_num):
        assert shown(float("nan")) == "nan"
        assert shown(math.inf) == "inf" and shown(-math.inf) == "-inf"
        assert shown(None) == MISSING
    assert num_text(np.float32(0.1)) == f"{float(np.float32(0.1)):.6g}"
    assert num_text(1.7e-6, 4) == "1.7e-06" and num_text(2**40) == str(2**40) and num_text(2**60) == f"{2**60:.6g}" and num_text(1e20) == "1e+20"


def test_formats_command_prints_limits_with_the_same_rule():
    out = CliRunner().invoke(app, ["formats"]).output
    fp16 = next(line for line in out.splitlines() if line.startswith("fp16 "))
    assert fp16.split()[2] == num_text(float(ml_dtypes.finfo(np.float16).max))
    e4m3 = next(line for line in out.splitlines() if line.startswith("fp8_e4m3fn "))
    assert e4m3.split()[2] == num_text(float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max))


def test_a_cosine_of_zero_reads_0_and_one_near_1_reads_its_deficit():
    from precision_lab.display import cosine_brief
    from precision_lab.metrics import compare

    ref = np.array([1.0, 0.0, 2.0, 0.0], np.float32)
    orth = np.array([0.0, 3.0, 0.0, 1.0], np.float32)  # orthogonal: cosine 0
    c = compare(ref, orth)
    assert float(ref.astype(np.float64) @ orth.astype(np.float64)) == 0.0
    assert cosine_brief(c.cosine, c.cosine_deficit) == "0"  # not "1-1"
    opp = compare(ref, -ref)
    assert cosine_brief(opp.cosine, opp.cosine_deficit) == "-1"
    near = ref + np.array([0.0, 1e-3, 0.0, 0.0], np.float32)
    c = compare(ref, near)
    r, n = ref.astype(np.float64), near.astype(np.float64)
    want = 1.0 - (r @ n) / (np.linalg.norm(r) * np.linalg.norm(n))
    assert cosine_brief(c.cosine, c.cosine_deficit) == f"1-{num_text(want, 3)}"
    same = compare(ref, ref)
    assert cosine_brief(same.cosine, same.cosine_deficit) == "1"
