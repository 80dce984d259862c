"""The report's ``first_nonfinite`` entries as JSON: the typed ``Origin`` (enums, tuples, nested values) writes the
same keys and plain values the document always had, each read back against the stored rows it names."""

from __future__ import annotations

import dataclasses
import json

import pytest

from precision_lab.origin import Origin
from precision_lab.services.ingest import ingest
from precision_lab.services.report import build_report, render_text, to_json
from precision_lab.store import queries as q

from conftest import SAMPLES

# every JSON value is one of these (a str subclass such as an enum member would print its class elsewhere)
_PLAIN = (str, int, float, bool, type(None))


def _plain(v) -> bool:
    if isinstance(v, dict):
        return all(type(k) is str and _plain(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    return type(v) in _PLAIN


@pytest.mark.slow
@pytest.mark.parametrize("sample", ["calibration-nan", "fp16-mlp-overflow"])
def test_first_nonfinite_json_names_the_stored_record_in_plain_values(store, sample):
    name = ingest([str(SAMPLES / sample)], store=store)
    report = build_report(store, name)
    sid = store.session(name).session_id
    runs = {r.name: r for r in q.session_runs(store, sid)}
    doc = json.loads(to_json(report))
    named = {run: f for run, f in doc["first_nonfinite"].items() if f is not None}
    assert named, f"{sample} names no origin"
    for run, f in named.items():
        # the keys: every field of Origin in its order, then producer
        assert list(f) == [x.name for x in dataclasses.fields(Origin)] + ["producer", "certainty_text"]
        assert _plain(f) and _plain(report.first_nonfinite[run].as_dict())
        # the values, read from the stored tensor record the answer names and from its run
        rec = q.rows(store, "SELECT * FROM tensors WHERE run_id = ? AND rid = ?", [f["run_id"], f["rid"]])[0]
        assert {k: f[k] for k in ("op", "op_type", "direction", "step", "rank", "role", "index", "location")} \
            == {k: rec[k] for k in ("op", "op_type", "direction", "step", "rank", "role", "index", "location")}
        assert f["run"] == run and f["run_id"] == runs[run].run_id and f["order"] == runs[run].order
        assert f["origin"] == "op" and f["producer"] is True and f["certainty"] == "certain" and f["order_known"]
        # the path ends at the op, each step a stored op call at or before it
        assert f["path"][-1]["op"] == f["op"] and [p["seq"] for p in f["path"]] == sorted(p["seq"] for p in f["path"])
        assert set(f["path"][0]) == {"op", "op_type", "seq", "nonfinite_in", "nonfinite_out"}
        # the text, as the JSON says: the words, never an enum's class name
        text = to_json(report)
        assert f'"origin": "op"' in text and '"certainty": "certain"' in text and "OriginKind" not in text
        assert f"  {run}: {f['op']}  (step {f['step']}, rank {f['rank']}, seq {f['seq']}, {f['role']} {f['index']})" \
            in render_text(report)


def test_origin_accepts_the_words_and_serialises_them_back():
    # an Origin made from the stored words (as an older caller does) holds the enums and writes the words back
    o = Origin(run="fp16", run_id="r1", op="m.fc.linear.0", op_type="linear", direction="backward", seq=3, step=0,
               rank=0, rid=7, role="grad_input", index="0", origin="parameter", reason="why", order="name",
               order_known=False, certainty="order unknown", others=["m.b"], intended=["m.mask"])
    d = o.as_dict()
    assert (d["origin"], d["direction"], d["order"], d["certainty"]) == ("parameter", "backward", "name",
                                                                         "order unknown")
    assert d["others"] == ["m.b"] and d["intended"] == ["m.mask"] and d["producer"] is False and _plain(d)
    assert f"{o.origin} {o.order}" == "parameter name" and o.origin == "parameter"
    with pytest.raises(ValueError):
        Origin(**{**dataclasses.asdict(o), "origin": "weight"})  # not one of OriginKind
