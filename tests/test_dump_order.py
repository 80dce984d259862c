"""Order of generic dumps and the producer in them: explicit order lists under
each manifest key, file modification times, and names (order unknown).

The dumps are a small torch model's module inputs and outputs saved with
forward hooks as ``<module path>.<input|output>.<idx>.npy``; an fp16
overflow is injected in one inner Linear by scaling its weight, so the true
origin is known and every variant must name it, never a container holding it.
"""

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab.ui.html_report import render_html
from precision_lab.readers.generic import ORDER_KEYS
from precision_lab.services.ingest import ingest
from precision_lab.services.report import build_report, first_nonfinite, render_text
from precision_lab.ui.overview import runs_table

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened

ORIGIN = "model.layers.0.mlp.down_proj"  # the Linear whose weight is scaled
CONTAINERS = ("model", "model.layers.0", "model.layers.0.mlp")
BASE_NS = 1_700_000_000_000_000_000


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _record(origin: str, dirpath, *, linked: bool = True):
    """Run the model in fp16 with ``origin``'s weight scaled past fp16's range; save every module's
    input 0 and output 0.  Returns (files in save order, tensor names in call order).

    ``linked=False`` saves the inputs as float32 copies, so no saved output is bit-identical to a saved
    input and the data says nothing about the order (the file times or the names must)."""
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.get_submodule(origin.removeprefix("model.")).weight.mul_(1.5e5)  # still finite in fp16, its products are not
    model = model.half()
    saved, calls, arrays = [], [], {}

    def pre(name):
        def hook(_mod, _inp):
            calls.extend([f"{name}.input.0", f"{name}.output.0"])
        return hook

    def post(name):
        def hook(_mod, inp, out):
            for role, t in (("input", inp[0]), ("output", out)):
                fn = f"{name}.{role}.0.npy"
                arrays[fn] = t.detach().numpy().copy()
                if role == "input" and not linked:
                    arrays[fn] = arrays[fn].astype(np.float32)
                saved.append(fn)
        return hook

    for sub, mod in model.named_modules():
        name = f"model.{sub}" if sub else "model"
        if isinstance(mod, nn.ModuleList):
            continue
        mod.register_forward_pre_hook(pre(name))
        mod.register_forward_hook(post(name))
    with torch.no_grad():
        model(torch.randn(4, 8).half())
    dirpath.mkdir(parents=True)
    for fn in saved:
        np.save(dirpath / fn, arrays[fn])
    # the injection did what it should: the origin's input is finite and its output is not
    assert np.isfinite(arrays[f"{origin}.input.0.npy"].astype(np.float32)).all()
    assert not np.isfinite(arrays[f"{origin}.output.0.npy"].astype(np.float32)).all()
    parts = origin.split(".")
    for c in (".".join(parts[:i]) for i in range(1, len(parts)) if not parts[i - 1] == "layers"):
        # each module holding the origin also has finite inputs and a non-finite output
        assert np.isfinite(arrays[f"{c}.input.0.npy"].astype(np.float32)).all()
        assert not np.isfinite(arrays[f"{c}.output.0.npy"].astype(np.float32)).all()
    return saved, calls


def _times(d, files, *, equal: bool, reverse: bool = False):
    seq = list(reversed(files)) if reverse else files
    for i, fn in enumerate(seq):
        t = BASE_NS if equal else BASE_NS + i * 1_000  # microseconds apart: only nanosecond times tell
        os.utime(d / fn, ns=(t, t))


def _run(store, name):
    sess = store.session(name)
    (info,) = sess.notes["ingest"]["runs"].values()
    return info, store.run(info["run_id"])


@pytest.mark.slow
@pytest.mark.parametrize("key", ORDER_KEYS)
@pytest.mark.parametrize("which", ["save", "call"])
def test_manifest_order_under_each_key(store, tmp_path, key, which):
    d = tmp_path / "dump"
    saved, calls = _record(ORIGIN, d)
    # "call": containers listed before their children, as a call-order list has them
    names = saved if which == "save" else calls
    (d / "manifest.json").write_text(json.dumps({"model": "toy", key: names}))
    _times(d, saved, equal=True)
    name = ingest(d, store=store)
    info, run = _run(store, name)
    assert info["order"] == "execution" and run.order == "execution"
    assert f'manifest.json ("{key}")' in info["order_from"]
    f = first_nonfinite(store, info["run_id"])
    assert f.op == ORIGIN and f.producer and f.order_known
    assert not store.df("SELECT * FROM warnings").shape[0]


def test_first_present_key_wins(store, tmp_path):
    d = tmp_path / "dump"
    saved, _calls = _record(ORIGIN, d)
    (d / "manifest.json").write_text(json.dumps({"call_order": list(reversed(saved)), "execution_order": saved}))
    name = ingest(d, store=store)
    info, _ = _run(store, name)
    assert '("execution_order")' in info["order_from"]
    seq = dict(store.df("SELECT op || '.' || role || '.' || \"index\" AS n, seq FROM tensors").values.tolist())
    assert [seq[fn[:-4]] for fn in saved] == list(range(len(saved)))
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


@pytest.mark.parametrize("fmt", ["order.json", "order.txt"])
def test_order_files(store, tmp_path, fmt):
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d)
    if fmt == "order.json":
        (d / fmt).write_text(json.dumps(saved))
    else:
        (d / fmt).write_text("\n".join(fn[:-4] for fn in saved) + "\n")
    info, _ = _run(store, ingest(d, store=store))
    assert info["order"] == "execution" and fmt in info["order_from"]
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


def test_distinct_mtimes_give_the_order(store, tmp_path):
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d, linked=False)
    _times(d, saved, equal=False)
    info, run = _run(store, ingest(d, store=store))
    assert info["order"] == "mtime" and run.order == "mtime"
    assert "order from file modification times" in info["order_from"]
    seq = dict(store.df("SELECT op || '.' || role || '.' || \"index\" AS n, seq FROM tensors").values.tolist())
    assert [seq[fn[:-4]] for fn in saved] == list(range(len(saved)))  # the save order, not the names'
    f = first_nonfinite(store, info["run_id"])
    assert f.op == ORIGIN and f.producer and f.order_known


def test_mtimes_that_put_containers_first(store, tmp_path):
    """Times in reverse save order: every container's records come before its children's."""
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d, linked=False)
    _times(d, saved, equal=False, reverse=True)
    info, _ = _run(store, ingest(d, store=store))
    assert info["order"] == "mtime"
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


@pytest.mark.slow
def test_equal_mtimes_fall_back_to_names(store, tmp_path):
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d, linked=False)
    _times(d, saved, equal=True)
    name = ingest(d, store=store)
    info, run = _run(store, name)
    assert info["order"] == "name" and run.order == "name"
    assert "order unknown: by name" in info["order_from"]
    f = first_nonfinite(store, info["run_id"])
    assert f.op == ORIGIN and f.producer and not f.order_known
    assert min(CONTAINERS) < ORIGIN  # by the alphabet a container would come first
    assert "order unknown: by name" in f.reason

    rep = build_report(store, name)
    assert rep.runs[0].order == "name" and rep.runs[0].order_text == "order unknown: by name"
    assert rep.first_nonfinite[run.name].op == ORIGIN
    text = render_text(rep)
    assert "order unknown: by name" in text and "execution order" not in text
    sid = store.session(name).session_id
    assert list(runs_table(store, sid)["order"]) == ["order unknown: by name"]
    page = render_html(store, name)
    assert "order unknown: by name" in page


def test_manifest_without_an_order_key(store, tmp_path):
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d, linked=False)
    (d / "manifest.json").write_text(json.dumps({"model": "toy", "modules": len(saved)}))
    _times(d, saved, equal=True)
    info, _ = _run(store, ingest(d, store=store))
    assert info["order"] == "name" and "order unknown: by name" in info["order_from"]
    w = store.df("SELECT file, message FROM warnings")
    assert list(w.file) == ["manifest.json"] and "call_order" in w.message[0]
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


@pytest.mark.parametrize("origin", ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.head"])
@pytest.mark.parametrize("times", ["equal", "distinct"])
def test_other_origins(store, tmp_path, origin, times):
    d = tmp_path / "dump"
    saved, _ = _record(origin, d, linked=False)
    _times(d, saved, equal=times == "equal")
    info, _ = _run(store, ingest(d, store=store))
    assert info["order"] == ("name" if times == "equal" else "mtime")
    assert first_nonfinite(store, info["run_id"]).op == origin


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_two_innermost_candidates_with_order_unknown(store, tmp_path):
    """Two parallel branches both overflow: with the order unknown either may be first; one is named,
    the reason says the order is unknown and lists the other."""
    torch.manual_seed(0)
    m = Branches()
    with torch.no_grad():
        m.a.weight.fill_(3e4)
        m.b.weight.fill_(3e4)
    m = m.half()
    x = torch.ones(2, 4).half()
    d = tmp_path / "dump"
    d.mkdir()
    with torch.no_grad():
        for name, fn in (("model", m), ("model.a", m.a), ("model.b", m.b)):
            np.save(d / f"{name}.input.0.npy", x.numpy())
            np.save(d / f"{name}.output.0.npy", fn(x).numpy())
    for p in d.iterdir():
        os.utime(p, ns=(BASE_NS, BASE_NS))
    info, _ = _run(store, ingest(d, store=store))
    f = first_nonfinite(store, info["run_id"])
    assert {f.op, *f.others} == {"model.a", "model.b"}
    assert "order unknown: by name" in f.reason and "may have run first" in f.reason


def test_extraction_and_upload_order_is_never_taken_for_execution_order(store, tmp_path):
    """Files written one after another by unzipping or uploading get distinct times; that order means nothing."""
    import io
    import zipfile

    from precision_lab.services.ingest import ingest
    from precision_lab.services.upload import write_upload

    blobs = {}
    for name in ("b.output.0.npy", "a.output.0.npy", "c.output.0.npy"):
        buf = io.BytesIO()
        np.save(buf, np.ones(4, np.float32))
        blobs[name] = buf.getvalue()
    z = tmp_path / "dump.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for name, data in blobs.items():
            zf.writestr(zipfile.ZipInfo(f"dump/{name}", date_time=(2024, 1, 2, 3, 4, 6)), data)
    up = write_upload([(f"dump/{n}", d) for n, d in blobs.items()], tmp_path / "up")
    for path in (z, up):
        name = ingest(path, store=store)
        orders = store.sql("SELECT r.\"order\" FROM runs r JOIN sessions s ON s.session_id = r.session_id "
                           "WHERE s.name = ?", [name]).fetchall()
        assert orders == [("name",)], (path, orders)


def _seqs(store):
    return dict(store.df("SELECT op || '.' || role || '.' || \"index\" AS n, seq FROM tensors").values.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("times", ["equal", "reverse"])
def test_order_recovered_from_the_data(store, tmp_path, times):
    """No order list: outputs bit-identical to later inputs give the order, ahead of file times and names."""
    d = tmp_path / "dump"
    saved, calls = _record(ORIGIN, d)
    _times(d, saved, equal=times == "equal", reverse=times == "reverse")
    name = ingest(d, store=store)
    info, run = _run(store, name)
    assert info["order"] == "data" and run.order == "data"
    assert "order recovered from the data" in info["order_from"]
    seq = _seqs(store)
    # every module that feeds another (its output is the next one's input in the real call order) comes first
    ops_in_call_order = [c.rsplit(".", 2)[0] for c in calls[::2]]
    leaves = [o for o in ops_in_call_order if not any(p.startswith(o + ".") for p in ops_in_call_order)]
    assert [seq[f"{o}.output.0"] for o in leaves] == sorted(seq[f"{o}.output.0"] for o in leaves)
    f = first_nonfinite(store, info["run_id"])
    assert f.op == ORIGIN and f.producer and f.order_known
    rep = build_report(store, name)
    assert rep.runs[0].order_text.startswith("order recovered from the data")
    assert "order unknown" not in render_text(rep)


@pytest.mark.parametrize("origin", ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.head"])
def test_other_origins_with_order_from_the_data(store, tmp_path, origin):
    d = tmp_path / "dump"
    saved, _ = _record(origin, d)
    _times(d, saved, equal=True)
    info, _ = _run(store, ingest(d, store=store))
    assert info["order"] == "data"
    assert first_nonfinite(store, info["run_id"]).op == origin


# ---- order lists as users write them, and bad ones ----------------------------------------------------

def _warnings(store):
    return store.df("SELECT file, message FROM warnings").to_dict("records")


@pytest.mark.parametrize("key,order", [("module_order", "call"), ("order", "completion")])
def test_a_list_of_module_names_covers_their_tensors_and_its_order_is_said(store, tmp_path, key, order):
    """``manifest.json`` naming modules, not tensors: each entry covers the module's input and output, and a
    list in call order (pre-order) is told from one in completion order (post-order)."""
    d = tmp_path / "dump"
    saved, calls = _record(ORIGIN, d, linked=False)
    modules = list(dict.fromkeys(c.rsplit(".", 2)[0] for c in calls))  # call order, as the pre-hooks ran
    if order == "completion":
        modules = list(dict.fromkeys(f.rsplit(".", 3)[0] for f in saved))  # as the forward hooks finished
    (d / "manifest.json").write_text(json.dumps({key: modules}))
    _times(d, saved, equal=True)
    info, run = _run(store, ingest(d, store=store))
    assert info["order"] == "execution"
    assert f"{order} order" in info["order_from"]
    assert not _warnings(store)  # every entry matched a module
    seq = _seqs(store)
    for m in modules:
        assert seq[f"{m}.input.0"] < seq[f"{m}.output.0"]  # inputs before outputs
    places = [min(seq[f"{m}.input.0"], seq[f"{m}.output.0"]) for m in modules]
    assert places == sorted(places)  # in the list's order
    f = first_nonfinite(store, info["run_id"])
    assert f.op == ORIGIN and f.producer


@pytest.mark.parametrize("doc,words", [
    ({"order": 5}, "not a list of tensor or module names"),
    ({"order": ["a", 3]}, "not a list of tensor or module names"),
    (["nothing.here", "nor.here"], "names no tensor or module of the dump"),
])
def test_a_bad_order_list_is_one_sentence_and_the_run_falls_back(store, tmp_path, doc, words):
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d)
    (d / "order.json").write_text(json.dumps(doc))
    _times(d, saved, equal=True)
    info, _ = _run(store, ingest(d, store=store))
    w = _warnings(store)
    assert len(w) == 1 and w[0]["file"] == "order.json" and words in w[0]["message"]
    assert "Traceback" not in w[0]["message"] and w[0]["message"].count(". ") == 0  # one sentence
    assert info["order"] == "data"  # the data still gives the order
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


def test_an_order_list_naming_an_entry_twice_or_unknown_ones_warns_once_each(store, tmp_path):
    d = tmp_path / "dump"
    saved, calls = _record(ORIGIN, d, linked=False)
    modules = list(dict.fromkeys(c.rsplit(".", 2)[0] for c in calls))
    (d / "order.txt").write_text("\n".join(modules[:3] + [modules[1], "no.such.module"] + modules[3:]) + "\n")
    _times(d, saved, equal=True)
    info, _ = _run(store, ingest(d, store=store))
    w = _warnings(store)
    assert [x["file"] for x in w] == ["order.txt", "order.txt"]
    assert "more than once" in w[0]["message"] and modules[1] in w[0]["message"]
    assert "no.such.module" in w[1]["message"] and "left out" in w[1]["message"]
    assert first_nonfinite(store, info["run_id"]).op == ORIGIN


@pytest.mark.parametrize("layout", ["dict", "tuple"])
def test_one_pt_per_module_holding_its_input_and_output(store, tmp_path, layout):
    d = tmp_path / "dump"
    d.mkdir()
    x = torch.arange(6.0).reshape(2, 3)
    y = x * 2
    obj = {"input": x, "output": y} if layout == "dict" else ((x,), y)
    torch.save(obj, d / "model.fc.pt")
    torch.save({"inputs": (y,), "out": y + 1} if layout == "dict" else ((y,), y + 1), d / "model.act.pt")
    info, _ = _run(store, ingest(d, store=store))
    got = store.df("SELECT op, role, \"index\", max FROM tensors ORDER BY seq").values.tolist()
    assert got == [["model.fc", "input", "0", 5.0], ["model.fc", "output", "0", 10.0],
                   ["model.act", "input", "0", 10.0], ["model.act", "output", "0", 11.0]]
    assert info["order"] == "data"  # fc's output is act's input


@pytest.mark.slow
def test_the_order_used_and_its_certainty_are_in_every_report_and_on_the_overview(store, tmp_path):
    """Coarse file times (four files per tick): the note says the times are certain between ticks and the ties
    were broken by the data, in the JSON, text and HTML reports and the Overview's runs table."""
    d = tmp_path / "dump"
    saved, _ = _record(ORIGIN, d)
    for i, fn in enumerate(saved):
        t = BASE_NS + (i // 4) * 1_000_000_000
        os.utime(d / fn, ns=(t, t))
    name = ingest(d, store=store)
    rep = build_report(store, name)
    note = rep.runs[0].order_note
    ticks = (len(saved) + 3) // 4
    assert rep.runs[0].order == "data"
    assert f"certain between the {ticks} distinct times" in note and "broken by the data" in note
    assert rep.first_nonfinite[rep.runs[0].name].op == ORIGIN
    text = render_text(rep)
    assert "Order used:" in text and note in text
    sid = store.session(name).session_id
    assert list(runs_table(store, sid)["order_used"]) == [note]
    page = render_html(store, name)
    assert "order used" in page and f"certain between the {ticks} distinct times" in page


def test_a_sequential_state_dict_in_a_pt_is_not_taken_for_args_and_output(store, tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    torch.save(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict(), d / "weights.pt")
    np.save(d / "x.npy", np.arange(4, dtype=np.float32))
    _run(store, ingest(d, store=store))
    got = set(store.df("SELECT op || ':' || role FROM tensors").iloc[:, 0])
    assert "weights.0.weight:tensor" in got and "weights.1.bias:tensor" in got
