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
