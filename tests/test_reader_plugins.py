"""A dump reader added from outside the package, the way a plug-in adds one: one module named by an entry point in
the ``precision_lab.readers`` group (and, for a file type the package does not read, a loader registered with
``register_file_type``), then a folder in its format ingested through the command line.  The modules are the worked
example of docs/architecture.md's "Adding a reader"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from precision_lab import readers
from precision_lab.readers import tensorfile

from plugin_kit import doc_examples, install

runner = CliRunner()

# the made-up format of the worked example: ``trace.tsv`` lists the ops in the order they ran (op, its type, role,
# tensor file), the tensors are files beside it; ``my_file_type.py`` reads them as text (``.tens``)
EXAMPLE = doc_examples("Adding a reader")
READER_ONLY = {"precision_lab.readers": ["trace = my_reader:READER"]}
REGISTRIES = (readers.READERS, tensorfile.FILE_TYPES)


@pytest.fixture
def added():
    readers_before, types_before = set(readers.READERS.names()), set(tensorfile.FILE_TYPES.names())
    yield
    for name in set(readers.READERS.names()) - readers_before:
        readers.unregister(name)
    for name in set(tensorfile.FILE_TYPES.names()) - types_before:
        tensorfile.FILE_TYPES.unregister(name)


OPS = [("embed", "embedding"), ("mlp.fc1", "linear"), ("mlp.act", "gelu"), ("mlp.fc2", "linear")]


def _values() -> dict[str, np.ndarray]:
    """One output per op; fc1's grows past fp16's max (65504), so the fp16 run overflows there first and its output
    holds inf."""
    rng = np.random.default_rng(38)
    x = rng.standard_normal((4, 16))
    fc1 = x * 3e4 + np.sign(x) * 6e4
    return {"embed": x, "mlp.fc1": fc1, "mlp.act": np.maximum(fc1, 0.0), "mlp.fc2": np.maximum(fc1, 0.0) * 2.0}


def _write_dump(folder: Path, dtype, suffix: str) -> dict[str, np.ndarray]:
    """A dump in the made-up format; returns each op's tensor as written."""
    folder.mkdir(parents=True)
    lines, written = [], {}
    for op, op_type in OPS:
        with np.errstate(over="ignore"):
            t = _values()[op].astype(dtype)
        file = f"{op}.output{suffix}"
        if suffix == ".npy":
            np.save(folder / file, t)
        else:
            body = "\n".join(" ".join(repr(float(v)) for v in row) for row in t.astype(np.float64))
            (folder / file).write_text(f"{np.dtype(dtype).name} {' '.join(map(str, t.shape))}\n{body}\n")
        lines.append(f"{op}\t{op_type}\toutput\t{file}")
        written[op] = t
    (folder / "trace.tsv").write_text("\n".join(lines) + "\n")
    return written


def _cli(*args):
    from precision_lab.cli import app

    return runner.invoke(app, [str(a) for a in args])


def _expected(t: np.ndarray) -> dict:
    """The statistics of one tensor, computed here in float64 over its finite values."""
    x = np.asarray(t, dtype=np.float64).ravel()
    fin = x[np.isfinite(x)]
    return {"numel": x.size, "nan_count": int(np.isnan(x).sum()), "inf_count": int(np.isinf(x).sum()),
            "absmax": float(np.abs(fin).max()), "mean": float(fin.mean()), "std": float(fin.std()),
            "l2norm": float(np.sqrt((fin * fin).sum()))}


def _ingest_and_check(tmp_path, suffix: str) -> None:
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store, close_all

    ref = _write_dump(tmp_path / "dumps" / "ref", np.float32, suffix)
    cand = _write_dump(tmp_path / "dumps" / "cand", np.float16, suffix)
    db = tmp_path / "lab.duckdb"
    r = _cli("ingest", tmp_path / "dumps" / "cand", "--reference", tmp_path / "dumps" / "ref",
             "--db", db, "--session", "traced")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "traced"
    store = Store(db)
    try:
        sid = store.session("traced").session_id
        runs = {r["kind"]: r for r in store.runs(sid).to_dict("records")}
        for kind, written in (("reference", ref), ("candidate", cand)):
            got = store.df("SELECT op, op_type, seq, dtype, numel, nan_count, inf_count, absmax, mean, std, l2norm "
                           "FROM tensors WHERE run_id = ? ORDER BY seq", [runs[kind]["run_id"]])
            assert list(got.op) == [op for op, _ in OPS] and list(got.op_type) == [t for _, t in OPS]
            assert list(got.seq) == [0, 1, 2, 3]
            for row in got.to_dict("records"):
                want = _expected(written[row["op"]])
                assert row["dtype"] == ("float32" if kind == "reference" else "float16")
                for k, v in want.items():
                    assert row[k] == pytest.approx(v, rel=1e-6), (kind, row["op"], k)
        # the fp16 run overflows first in fc1, which the reference holds finite
        assert int(np.isinf(cand["mlp.fc1"]).sum()) > 0 and np.isfinite(ref["mlp.fc1"]).all()
        origin = first_nonfinite(store, runs["candidate"]["run_id"])
        assert origin.op == "mlp.fc1"
        diags = store.df("SELECT rule, op, message FROM diagnoses WHERE run_id = ? AND severity = 'error'",
                         [runs["candidate"]["run_id"]])
        # the diagnosis names the op and the reference's largest value there, which fp16 cannot hold
        absmax = float(np.abs(ref["mlp.fc1"].astype(np.float64)).max())
        assert list(zip(diags.rule, diags.op)) == [("overflow", "mlp.fc1")]
        assert diags.message.iloc[0].startswith(
            f"`mlp.fc1` output absmax {absmax:,.0f} (fp32 reference) > fp16 max 65,504: ")
    finally:
        close_all()


def test_a_reader_from_an_entry_point_ingests_its_format_through_the_cli(tmp_path, monkeypatch, added):
    assert sorted(EXAMPLE) == ["my_file_type.py", "my_reader.py"]
    install(tmp_path, monkeypatch, {"my_reader.py": EXAMPLE["my_reader.py"]}, READER_ONLY, REGISTRIES)
    assert readers.READERS.names()[-1] == "trace-tsv"
    # ahead of the generic reader, which would otherwise take a folder of .npy files
    names = [r.name for r in readers.ordered()]
    assert names.index("trace-tsv") < names.index("generic")
    _ingest_and_check(tmp_path, ".npy")


def test_a_reader_of_a_new_file_type_is_two_modules(tmp_path, monkeypatch, added):
    install(tmp_path, monkeypatch, EXAMPLE,
            {**READER_ONLY, "precision_lab.file_types": ["tens = my_file_type"]}, REGISTRIES)
    assert "trace-tsv" in readers.READERS and ".tens" in tensorfile.FILE_TYPES
    _ingest_and_check(tmp_path, ".tens")
    # every path that re-reads a stored record's tensor (comparison, replay) opens the new type with its loader
    cand = tmp_path / "dumps" / "cand"
    back = tensorfile.load_source(cand, "mlp.fc1.output.tens")
    with np.errstate(over="ignore"):
        assert back.dtype == np.float16 and np.array_equal(back, _values()["mlp.fc1"].astype(np.float16))


BROKEN = '''
from pathlib import Path


class Broken:
    name = "broken"
    priority = 70

    def detect(self, root: Path) -> bool:
        if (root / "boom-detect").exists():
            raise KeyError("boom-detect")
        return (root / "trace.tsv").is_file()

    def iter_runs(self, root: Path, tick):
        raise ZeroDivisionError("the plug-in divided by zero")
        yield


READER = Broken()
'''


@pytest.mark.parametrize("marker, said", [
    ("", "the dump cannot be read (the plug-in divided by zero)"),
    ("boom-detect", "cannot be read (the 'broken' reader failed on it: KeyError: 'boom-detect')"),
])
def test_a_reader_that_raises_is_one_sentence_naming_the_folder(tmp_path, monkeypatch, added, marker, said):
    install(tmp_path, monkeypatch, {"pl_broken_reader.py": BROKEN},
            {"precision_lab.readers": ["broken = pl_broken_reader:READER"]}, REGISTRIES)
    dump = tmp_path / "dumps" / "cand"
    _write_dump(dump, np.float16, ".npy")
    if marker:
        (dump / marker).write_text("")
    r = _cli("ingest", dump, "--db", tmp_path / "lab.duckdb")
    assert r.exit_code == 2, r.output
    assert r.output == f"error: {dump}: {said}\n"
