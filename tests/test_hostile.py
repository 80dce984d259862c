"""Hostile and broken session imports and browser uploads.  Every refusal must
name the file and the problem, and leave the database exactly as it was.
(Malformed dump files: tests/test_malformed_inputs.py.)
"""

import hashlib
import io
import json
import os
import stat
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precision_lab.config import ServerConfig
from precision_lab.services.share import ShareError, export_bytes, import_session
from test_share import make_session

from conftest import TABLES, refused

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened


# ---- exported sessions -------------------------------------------------------------

@pytest.fixture(scope="module")
def _exports(tmp_path_factory):
    from precision_lab.store import Store

    src = Store(tmp_path_factory.mktemp("src") / "src.duckdb")
    make_session(src, "shared", seed=5)
    make_session(src, "other", seed=6)
    return export_bytes(src, "shared"), export_bytes(src, "other")


@pytest.fixture(scope="module")
def _with_mine(tmp_path_factory) -> Path:
    """A database holding the session ``mine``, written once for the module."""
    from precision_lab.store import Store, close_all

    db = Store(tmp_path_factory.mktemp("mine") / "mine.duckdb")
    make_session(db, "mine")
    close_all()
    return Path(db.path)


@pytest.fixture
def store_template(request, _empty_database, _with_mine) -> Path:
    """A test of ``exported`` starts from a copy of ``_with_mine``."""
    return _with_mine if "exported" in request.fixturenames else _empty_database


@pytest.fixture
def exported(store, _exports):
    """The zip bytes of two sessions exported elsewhere; ``store`` already holds a session that must survive
    (``mine``, see ``store_template``)."""
    assert store.session("mine")
    return _exports


def rezip(data: bytes, *, replace=None, manifest=None, extra=(), drop=(), fix=True) -> bytes:
    """Rebuild an exported zip: swap file contents, edit the manifest, add or drop entries.

    ``fix``: recompute the manifest's checksums and row counts for swapped
    files, as a careful forger would, so the later checks are what refuse it.
    """
    replace = dict(replace or {})
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    m = json.loads(files.pop("manifest.json"))
    for name, b in replace.items():
        files[name] = b
        table = name.removesuffix(".parquet")
        if fix and table in m["tables"]:
            m["tables"][table]["sha256"] = hashlib.sha256(b).hexdigest()
            try:
                m["tables"][table]["rows"] = pq.read_table(io.BytesIO(b)).num_rows
            except Exception:
                pass
    if manifest is not None:
        m = manifest(m)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("manifest.json", m if isinstance(m, (bytes, str)) else json.dumps(m))
        for n, b in files.items():
            if n not in drop:
                zf.writestr(n, b)
        for item in extra:
            if isinstance(item[0], zipfile.ZipInfo):
                zf.writestr(item[0], item[1])
            else:
                zf.writestr(*item)
    return out.getvalue()


def table_of(data: bytes, name: str) -> pa.Table:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return pq.read_table(io.BytesIO(zf.read(f"{name}.parquet")))


def parquet(t: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(t, buf)
    return buf.getvalue()


def set_col(t: pa.Table, name: str, values, type=None) -> pa.Table:
    return t.set_column(t.column_names.index(name), name, pa.array(values, type=type or t.schema.field(name).type))


def imp(store, data, name="upload.zip", **kw):
    return lambda: import_session(store, data, filename=name, **kw)


def test_import_not_a_zip(store, exported):
    refused(store, imp(store, b"MZ\x90\x00 this is an executable, not a zip", "evil.zip"), ShareError,
            "evil.zip", "not a readable zip archive")


def test_import_empty_file(store, exported):
    refused(store, imp(store, b"", "empty.zip"), ShareError, "empty.zip", "not a readable zip")


def test_import_truncated_zip(store, exported):
    data, _ = exported
    refused(store, imp(store, data[: len(data) // 2], "half.zip"), ShareError, "half.zip", "not a readable zip")


def test_import_zip_without_manifest(store, exported):
    data, _ = exported
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z2:
            for n in zf.namelist():
                if n != "manifest.json":
                    z2.writestr(n, zf.read(n))
    refused(store, imp(store, out.getvalue(), "nomani.zip"), ShareError, "nomani.zip", "no manifest.json",
            "not an exported Precision Lab session")


def test_import_dump_zip_is_not_a_session(store, tmp_path):
    """Someone uploads a dump zip to the import box."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("dump/a.output.0.npy", b"\x93NUMPY")
    refused(store, imp(store, out.getvalue(), "dump.zip"), ShareError, "dump.zip", "no manifest.json")


@pytest.mark.parametrize("manifest, words", [
    (b"{not json", ["not valid JSON"]),
    (b'{"format": NaN}', ["not valid JSON", "NaN"]),
    (b"\xff\xfe{}", ["not UTF-8"]),
    (b"[1, 2, 3]", ["must hold a JSON object"]),
    (lambda m: dict(m, format="something-else"), ["format 'something-else'", "not an exported"]),
    (lambda m: dict(m, format_version=99), ["format version 99", "upgrade"]),
    (lambda m: dict(m, format_version="1"), ["no integer format_version"]),
    (lambda m: dict(m, schema_version=999), ["schema version 999", "upgrade"]),
    (lambda m: dict(m, session={"name": "x"}), ["must name the session"]),
    (lambda m: dict(m, tables={k: v for k, v in m["tables"].items() if k != "diagnoses"}),
     ["does not list table(s) diagnoses"]),
    (lambda m: dict(m, tables=dict(m["tables"], secrets={"file": "secrets.parquet", "rows": 0, "sha256": "0" * 64})),
     ["unknown table(s) 'secrets'"]),
    (lambda m: {**m, "tables": {**m["tables"], "runs": {**m["tables"]["runs"], "file": "../runs.parquet"}}},
     ["'../runs.parquet'", "expected 'runs.parquet'"]),
    (lambda m: {**m, "tables": {**m["tables"], "runs": {**m["tables"]["runs"], "rows": -1}}},
     ["table runs has no valid row count"]),
    (lambda m: {**m, "tables": {**m["tables"], "runs": {**m["tables"]["runs"], "sha256": "abc"}}},
     ["table runs has no valid sha256"]),
], ids=["not-json", "nan-constant", "not-utf8", "array", "format", "future-format", "string-version",
        "future-schema", "no-session-id", "missing-table", "unknown-table", "path-in-file", "negative-rows",
        "bad-checksum-text"])
def test_import_bad_manifest(store, exported, manifest, words):
    data, _ = exported
    bad = rezip(data, manifest=(lambda m: manifest) if isinstance(manifest, bytes) else manifest)
    refused(store, imp(store, bad, "lying.zip"), ShareError, "lying.zip", "manifest.json", *words)


def test_import_manifest_lies_about_row_count(store, exported):
    data, _ = exported
    bad = rezip(data, manifest=lambda m: {**m, "tables": {**m["tables"], "tensors": {
        **m["tables"]["tensors"], "rows": m["tables"]["tensors"]["rows"] + 1}}})
    refused(store, imp(store, bad, "lying.zip"), ShareError, "lying.zip", "says tensors.parquet holds 19 rows",
            "holds 18")


def test_import_file_changed_after_export(store, exported):
    data, other = exported
    swapped = rezip(data, replace={"tensors.parquet": parquet(table_of(other, "tensors"))}, fix=False)
    refused(store, imp(store, swapped, "tampered.zip"), ShareError, "tampered.zip", "tensors.parquet",
            "does not match the checksum")


def test_import_rows_of_another_session(store, exported):
    """A forger who recomputes checksums still cannot smuggle in another session's rows."""
    data, other = exported
    bad = rezip(data, replace={"runs.parquet": parquet(table_of(other, "runs"))})
    refused(store, imp(store, bad, "mixed.zip"), ShareError, "mixed.zip", "runs.parquet",
            "rows of another session")


def test_import_record_of_unknown_run(store, exported):
    data, _ = exported
    t = table_of(data, "tensors")
    bad = rezip(data, replace={"tensors.parquet": parquet(set_col(t, "run_id", ["ffffffffffff"] * t.num_rows))})
    refused(store, imp(store, bad, "orphans.zip"), ShareError, "orphans.zip", "tensors.parquet",
            "refers to run 'ffffffffffff'", "runs.parquet does not hold")


def test_import_duplicate_records(store, exported):
    data, _ = exported
    t = table_of(data, "tensors")
    bad = rezip(data, replace={"tensors.parquet": parquet(set_col(t, "rid", [0] * t.num_rows))})
    refused(store, imp(store, bad, "dups.zip"), ShareError, "dups.zip", "tensors.parquet",
            "lists a (run_id, rid) more than once")


def test_import_histogram_of_a_record_tensors_do_not_hold(store, exported):
    data, _ = exported
    h = table_of(data, "histograms")
    rids = h.column("rid").to_pylist()
    bad = rezip(data, replace={"histograms.parquet": parquet(set_col(h, "rid", [rids[0] + 10_000] + rids[1:]))})
    refused(store, imp(store, bad, "ghost.zip"), ShareError, "ghost.zip", "histograms.parquet",
            f"refers to record {rids[0] + 10_000} of run", "tensors.parquet does not hold")


def test_import_histogram_listed_twice(store, exported):
    data, _ = exported
    h = table_of(data, "histograms")
    rids, runs = h.column("rid").to_pylist(), h.column("run_id").to_pylist()
    h = set_col(set_col(h, "rid", [rids[1]] + rids[1:]), "run_id", [runs[1]] + runs[1:])  # row 0 = row 1's record
    bad = rezip(data, replace={"histograms.parquet": parquet(h)})
    refused(store, imp(store, bad, "twice.zip"), ShareError, "twice.zip", "histograms.parquet",
            "lists a record more than once")


def test_import_histogram_bins_that_are_not_numbers(store, exported):
    data, _ = exported
    h = table_of(data, "histograms")
    words = [["x"] * len(b) for b in h.column("bins").to_pylist()]
    bad = rezip(data, replace={"histograms.parquet": parquet(set_col(h, "bins", words, pa.list_(pa.string())))})
    refused(store, imp(store, bad, "words.zip"), ShareError, "words.zip", "histograms.parquet column 'bins' holds "
            "list<element: string> where table histograms keeps INTEGER[]")


def test_import_record_ids_that_are_text(store, exported):
    """rid '0' and '00' are two values to a check and one record once stored as BIGINT: refused by type."""
    data, _ = exported
    t = table_of(data, "tensors")
    rids = [("0" * (i % 2 + 1)) if i < 2 else str(r) for i, r in enumerate(t.column("rid").to_pylist())]
    bad = rezip(data, replace={"tensors.parquet": parquet(set_col(t, "rid", rids, pa.string()))})
    refused(store, imp(store, bad, "text.zip"), ShareError, "text.zip", "tensors.parquet column 'rid' holds string",
            "keeps BIGINT")


def test_import_session_name_disagrees_with_manifest(store, exported):
    data, _ = exported
    bad = rezip(data, manifest=lambda m: {**m, "session": {**m["session"], "name": "innocent"}})
    refused(store, imp(store, bad, "renamed.zip"), ShareError, "renamed.zip", "describes session 'shared'",
            "says 'innocent'")


def test_import_histogram_bin_out_of_range(store, exported):
    from precision_lab.stats import N_BINS

    data, _ = exported
    t = table_of(data, "histograms")
    bins = t.column("bins").to_pylist()
    bins[0] = [N_BINS + 5] + bins[0][1:]
    bad = rezip(data, replace={"histograms.parquet": parquet(set_col(t, "bins", bins))})
    refused(store, imp(store, bad, "bins.zip"), ShareError, "bins.zip", "histograms.parquet",
            f"outside 0..{N_BINS - 1}")


def test_import_kept_tensor_with_pickle_is_never_loaded(store, exported, tmp_path):
    data, _ = exported
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    np.save(buf, np.array([Boom()], dtype=object), allow_pickle=True)
    t = table_of(data, "tensor_data")
    blobs = t.column("npy").to_pylist()
    blobs[0] = buf.getvalue()
    bad = rezip(data, replace={"tensor_data.parquet": parquet(set_col(t, "npy", blobs))})
    refused(store, imp(store, bad, "pickle.zip"), ShareError, "pickle.zip", "tensor_data.parquet",
            "Python objects (a pickle), which are never loaded")
    assert not marker.exists()


def test_import_kept_tensor_shorter_than_its_header(store, exported):
    data, _ = exported
    t = table_of(data, "tensor_data")
    blobs = t.column("npy").to_pylist()
    blobs[3] = blobs[3][:-8]
    bad = rezip(data, replace={"tensor_data.parquet": parquet(set_col(t, "npy", blobs))})
    refused(store, imp(store, bad, "short.zip"), ShareError, "short.zip", "kept tensor of record",
            "header says shape [4, 8] float32 but the data has a different length")


def test_import_unknown_column(store, exported):
    data, _ = exported
    t = table_of(data, "runs")
    t = t.append_column("owner_password", pa.array(["hunter2"] * t.num_rows))
    bad = rezip(data, replace={"runs.parquet": parquet(t)})
    refused(store, imp(store, bad, "newer.zip"), ShareError, "newer.zip", "runs.parquet",
            "'owner_password'", "does not have")


def test_import_table_that_is_not_parquet(store, exported):
    data, _ = exported
    bad = rezip(data, replace={"diagnoses.parquet": b"PAR1 but not really"})
    refused(store, imp(store, bad, "notpq.zip"), ShareError, "notpq.zip", "diagnoses.parquet",
            "not a readable Parquet file")


def test_import_uncastable_value_rolls_back(store, exported):
    """Rows of the first tables are inserted before the bad one fails: the transaction takes them back."""
    data, _ = exported
    t = table_of(data, "comparisons")
    t = set_col(t, "seq", [2 ** 64 - 1] * t.num_rows, type=pa.uint64())  # an integer, too large for BIGINT
    bad = rezip(data, replace={"comparisons.parquet": parquet(t)})
    refused(store, imp(store, bad, "types.zip"), ShareError, "types.zip", "comparisons.parquet",
            "cannot be stored in table comparisons")
    assert import_session(store, data).session == "shared"  # the good file still imports afterwards


def test_import_listed_file_missing(store, exported):
    data, _ = exported
    refused(store, imp(store, rezip(data, drop=("warnings.parquet",)), "missing.zip"), ShareError,
            "missing.zip", "lists warnings.parquet but the zip does not hold it")


def test_import_extra_unlisted_file(store, exported):
    data, _ = exported
    bad = rezip(data, extra=[("run_me.py", b"import os; os.system('rm -rf ~')")])
    refused(store, imp(store, bad, "extra.zip"), ShareError, "extra.zip", "'run_me.py' is not listed")


@pytest.mark.slow
def test_import_zip_slip(store, exported, tmp_path):
    data, _ = exported
    bad = rezip(data, extra=[("../../evil.parquet", b"x")])
    refused(store, imp(store, bad, "slip.zip"), ShareError, "slip.zip", "'../../evil.parquet'",
            "leaves the extraction folder")
    bad = rezip(data, extra=[("/etc/cron.d/evil", b"x")])
    refused(store, imp(store, bad, "abs.zip"), ShareError, "abs.zip", "absolute path")


def test_import_zip_symlink(store, exported):
    data, _ = exported
    info = zipfile.ZipInfo("link")
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    refused(store, imp(store, rezip(data, extra=[(info, b"/etc/passwd")]), "link.zip"), ShareError,
            "link.zip", "'link'", "symbolic link")


@pytest.mark.slow
def test_import_zip_bomb_size_and_count(store, exported):
    data, _ = exported
    zeros = zipfile.ZipInfo("zeros.bin")
    zeros.compress_type = zipfile.ZIP_DEFLATED
    bomb = rezip(data, extra=[(zeros, b"\0" * (3 << 20))])
    assert len(bomb) < len(data) + 50_000  # 3 MiB of zeros compress to a few kB
    refused(store, imp(store, bomb, "bomb.zip"), ShareError, "bomb.zip", "'zeros.bin' expands", "zip bomb")
    big = rezip(data, extra=[("noise.bin", np.random.default_rng(0).bytes(3 << 20))])
    refused(store, imp(store, big, "big.zip", config=ServerConfig(zip_max_total_mb=2)), ShareError,
            "big.zip", "uncompressed size exceeds the limit")
    many = rezip(data, extra=[(f"f{i}", b"") for i in range(10_000)])
    refused(store, imp(store, many, "many.zip", config=ServerConfig(zip_max_files=5000)), ShareError,
            "many.zip", f"{10_000 + len(TABLES)} entries exceed the limit of 5000 files")


def test_import_upload_over_size_limit(store, exported, tmp_path):
    data, _ = exported
    big = rezip(data, extra=[("pad.bin", os.urandom((1 << 20) + 10))])
    refused(store, imp(store, big, "big.zip", config=ServerConfig(max_upload_mb=1)), ShareError,
            "big.zip", "more than the upload limit of 1 MiB")


def test_import_huge_manifest(store, exported):
    data, _ = exported
    bad = rezip(data, manifest=lambda m: dict(m, padding="x" * (2 << 20)))
    refused(store, imp(store, bad, "fat.zip"), ShareError, "fat.zip", "manifest.json is", "more than a manifest")


# ---- browser uploads ------------------------------------------------------------------

def upload(store, files, **kw):
    from precision_lab.ui.sessions import IngestFailed, ingest_upload

    return lambda: ingest_upload(store, files, **kw), IngestFailed


def _npy(a) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


@pytest.mark.parametrize("name, words", [
    ("dump/../../../etc/cron.d/x.npy", ["leaves the upload folder"]),
    ("/etc/passwd.npy", ["absolute path"]),
    ("C:\\Windows\\evil.npy", ["absolute path"]),
    ("dump/a\x00b.npy", ["NUL character"]),
], ids=["dotdot", "absolute", "drive-letter", "nul"])
def test_upload_unsafe_names(store, tmp_path, name, words):
    fn, exc = upload(store, [("dump/ok.output.0.npy", _npy(np.ones(3, np.float32))), (name, b"x")])
    refused(store, fn, exc, repr(name)[1:-1][:20], *words)
    assert not Path("/etc/cron.d/x.npy").exists()


def test_upload_nested_too_deep(store):
    name = "dump/" + "d/" * 40 + "a.output.0.npy"
    fn, exc = upload(store, [(name, _npy(np.ones(2, np.float32)))], max_depth=32)
    refused(store, fn, exc, "nested 41 folders deep", "limit of 32")


def test_upload_pickle_payload_is_not_executed(store, tmp_path):
    import torch

    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": Boom()}, buf)
    fn, exc = upload(store, [("dump/evil.pt", buf.getvalue()),
                             ("dump/ok.output.0.npy", _npy(np.ones(3, np.float32)))])
    refused(store, fn, exc, "evil.pt", "weights_only")
    assert not marker.exists()


def test_upload_zip_slip_inside_zip(store):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("ok.output.0.npy", _npy(np.ones(3, np.float32)))
        zf.writestr("../../outside.npy", _npy(np.ones(3, np.float32)))
    fn, exc = upload(store, [("dump.zip", out.getvalue())])
    refused(store, fn, exc, "dump.zip", "'../../outside.npy'", "leaves the extraction folder")


def test_upload_zip_of_ten_thousand_tiny_files(store):
    from precision_lab.safezip import ZipLimits

    out = io.BytesIO()
    tiny = _npy(np.ones(1, np.float32))
    with zipfile.ZipFile(out, "w") as zf:
        for i in range(10_000):
            zf.writestr(f"t{i:05d}.output.0.npy", tiny)
    fn, exc = upload(store, [("tiny.zip", out.getvalue())], zip_limits=ZipLimits(max_files=5000))
    refused(store, fn, exc, "tiny.zip", "10000 entries exceed the limit of 5000 files")
