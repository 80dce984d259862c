"""Non-finite floats through strict JSON and back: one encoder and one decoder for reports, shards and stats."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from precision_lab.jsoncodec import decode_nonfinite, dumps, fields_tree, from_json_float, json_float
from precision_lab.metrics import compare
from precision_lab.stats import tensor_stats


def test_round_trip_of_every_non_finite_value_through_strict_json():
    values = [float("nan"), math.inf, -math.inf, 0.0, -0.0, 5e-324, 1.7976931348623157e308, np.float32(0.1)]
    text = dumps({"v": values, "nested": {"x": np.float64(-math.inf)}})
    def no_constants(c):
        raise AssertionError(f"strict JSON has no {c}")

    json.loads(text, parse_constant=no_constants)
    with pytest.raises(ValueError):
        json.dumps(float("nan"), allow_nan=False)  # what a strict encoder does without the codec
    back = [decode_nonfinite(v) for v in json.loads(text)["v"]]
    assert math.isnan(back[0]) and back[1] == math.inf and back[2] == -math.inf
    assert back[3:7] == [0.0, -0.0, 5e-324, 1.7976931348623157e308] and math.copysign(1, back[4]) == -1
    assert back[7] == float(np.float32(0.1))
    assert decode_nonfinite("inf-ish") == "inf-ish" and from_json_float(json_float(None)) is None


def test_stats_and_comparisons_survive_the_codec():
    x = np.array([1.0, np.inf, -np.inf, np.nan, 3.0], dtype=np.float32)
    s = tensor_stats(x)
    back = type(s).from_dict(json.loads(json.dumps(s.to_dict(), allow_nan=False)))
    assert back.inf_count == 2 and back.nan_count == 1 and back.absmax == 3.0 and back.min == 1.0
    assert math.isnan(s.mean) == math.isnan(back.mean) and np.array_equal(back.hist, s.hist)
    c = compare(np.ones(4, np.float32), np.array([1, 1, np.inf, 1], np.float32))
    d = {k: decode_nonfinite(v) for k, v in json.loads(dumps(c.to_dict())).items()}
    for k, v in c.to_dict().items():
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(d[k])
        else:
            assert d[k] == v, k


def test_a_frozen_result_travels_as_its_fields_in_declared_order():
    from dataclasses import dataclass

    @dataclass(frozen=True, slots=True)
    class Inner:
        b: float
        a: str

    @dataclass(frozen=True, slots=True)
    class Outer:
        z: int
        rows: list
        pair: tuple

    v = Outer(1, [Inner(math.inf, "x")], (Inner(np.float32(0.5), "y"), None))
    assert dumps(v) == '{"z": 1, "rows": [{"b": "inf", "a": "x"}], "pair": [{"b": 0.5, "a": "y"}, null]}'
    tree = fields_tree({"k": v})
    assert list(tree["k"]) == ["z", "rows", "pair"] and tree["k"]["rows"][0] == {"b": math.inf, "a": "x"}
    assert isinstance(tree["k"]["pair"], tuple) and fields_tree(Inner) is Inner  # a class is no result
