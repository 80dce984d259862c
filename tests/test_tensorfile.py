"""The one tensor-file loader (readers.tensorfile): compare re-reads through it, and it refuses damaged files."""

import shutil
import zipfile

import numpy as np
import pytest
from typer.testing import CliRunner

from precision_lab.readers import ReadError, detect
from precision_lab.readers.tensorfile import load_source, read_tensors

FIXTURES = __import__("tests.conftest", fromlist=["FIXTURES"]).FIXTURES
TENSORS = "step0/proc22432/dump_tensor_data"  # the fp16 candidate's
REF_TENSORS = "step0/proc22421/dump_tensor_data"


def _member_data_start(path, info) -> int:
    raw = path.read_bytes()
    head = raw[info.header_offset:info.header_offset + 30]
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


def _flip_data_byte(path) -> None:
    """Flip the lowest bit of the first data byte of the file's first stored tensor member: a valid number still,
    so only the member's CRC-32 tells."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl"))
    raw = bytearray(path.read_bytes())
    raw[_member_data_start(path, info)] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture
def dumps(tmp_path):
    ref = shutil.copytree(FIXTURES / "tensor_mix_fp32", tmp_path / "ref")
    cand = shutil.copytree(FIXTURES / "tensor_mix_fp16", tmp_path / "cand")
    return ref, cand


def test_compare_refuses_a_damaged_tensor_file(dumps, tmp_path):
    """``precision-lab compare`` with a byte flipped in a candidate tensor: one error line naming it, exit 2."""
    from precision_lab.cli import app

    ref, cand = dumps
    rel = f"{TENSORS}/Functional.linear.0.forward.output.0.pt"
    ok = CliRunner().invoke(app, ["compare", str(ref), str(cand)])
    assert ok.exit_code == 0, ok.output
    _flip_data_byte(cand / rel)
    res = CliRunner().invoke(app, ["compare", str(ref), str(cand)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {rel}: damaged .pt archive: entry ") and "CRC-32" in lines[0]


def test_compare_rereads_through_the_checked_loader(dumps, tmp_path):
    """A reference tensor damaged after it was read and before compare re-reads it (no cache): ingest fails
    naming the file, and nothing is stored."""
    from precision_lab.services.ingest import IngestError, ingest
    from precision_lab.store import Store, close_all

    ref, cand = dumps
    rel = f"{REF_TENSORS}/Functional.linear.0.forward.output.0.pt"

    def progress(done, total, label):
        if label == "step0/proc22432/dump.json":  # the candidate starts: the reference has been read
            _flip_data_byte(ref / rel)

    store = Store(tmp_path / "c.duckdb")
    try:
        with pytest.raises(IngestError) as e:
            ingest([cand], reference=[ref], store=store, cache_bytes=0, progress=progress)
        assert str(e.value).startswith(f"{rel}: damaged .pt archive") and "CRC-32" in str(e.value)
        assert store.sessions().empty
    finally:
        close_all()


def test_run_source_load_and_load_source_agree_and_refuse(dumps):
    """``RunSource.load`` (compare's re-read) is ``load_source``: same numbers, same refusal."""
    ref, _ = dumps
    src = next(detect(ref).iter_runs(ref, lambda n, label: None))
    rec = next(r for r in src.records if r.source.endswith(".pt"))
    a, b = src.load(rec.source), load_source(ref, rec.source)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(rec.tensor))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(rec.tensor))
    _flip_data_byte(ref / rec.source)
    for load in (src.load, lambda s: load_source(ref, s)):
        with pytest.raises(ReadError, match=rf"^{rec.source}: damaged \.pt archive: entry '.*' fails its check"):
            load(rec.source)


def test_load_source_stays_inside_the_dump(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    np.save(tmp_path / "outside.npy", np.ones(3, np.float32))
    with pytest.raises(ReadError, match=r"points outside the dump"):
        load_source(d, "../outside.npy")
    with pytest.raises(ReadError, match=r"^gone\.npy: file not found$"):
        load_source(d, "gone.npy")
    (d / "link.npy").symlink_to(tmp_path / "outside.npy")
    with pytest.raises(ReadError, match=r"^link\.npy: is a symbolic link"):
        load_source(d, "link.npy")


def test_npz_member_damaged_is_named(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    w = np.arange(64, dtype=np.float32)
    np.savez(d / "z.npz", w=w, v=w[::-1].copy())
    assert [k for k, _ in read_tensors(d / "z.npz", "z.npz", d)] == ["v", "w"]
    np.testing.assert_array_equal(load_source(d, "z.npz#w"), w)
    with zipfile.ZipFile(d / "z.npz") as z:
        info = z.getinfo("w.npy")
    raw = bytearray((d / "z.npz").read_bytes())
    raw[_member_data_start(d / "z.npz", info) + info.file_size - 1] ^= 0x40  # inside w's last float
    (d / "z.npz").write_bytes(bytes(raw))
    with pytest.raises(ReadError, match=r"^z\.npz: damaged \.npz archive: entry 'w\.npy' fails its check"):
        load_source(d, "z.npz#w")


def test_shard_kept_tensor_through_load_source(tmp_path):
    from precision_lab.readers.shards import write_manifest, write_shard
    from precision_lab.records import TensorRecord
    from precision_lab.stats import tensor_stats

    t = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    rec = TensorRecord(run_id="r", seq=0, op="fc", op_type="Linear", role="output", index="0",
                       stats=tensor_stats(t), tensor=t, step=2, rank=1)
    path = write_shard(tmp_path, {"name": "r", "run_id": "r"}, [rec], rank=1, step=2)
    write_manifest(tmp_path, [{"name": "r", "run_id": "r"}])
    src = path.relative_to(tmp_path).as_posix()
    np.testing.assert_array_equal(load_source(tmp_path, src, name=rec.name, step=2, rank=1), t)
    assert load_source(tmp_path, src, name=rec.name, step=0, rank=1) is None


def test_a_tensor_digests_alike_read_with_or_without_torch(tmp_path):
    """A plain bf16 ``.pt`` is read without torch (an ml_dtypes array), one inside a container by torch: the
    same bits must give the same digest, or a generic dump's output -> input links are lost between them."""
    import ml_dtypes
    import torch

    from precision_lab.readers.dataorder import digest

    g = torch.Generator().manual_seed(2)
    t = (torch.randn(4, 8, generator=g) * 4).to(torch.bfloat16)
    torch.save(t, tmp_path / "plain.pt")
    torch.save({"input": t, "output": t.float()}, tmp_path / "module.pt")
    [(_, plain)] = read_tensors(tmp_path / "plain.pt", "plain.pt", tmp_path)
    boxed = dict(read_tensors(tmp_path / "module.pt", "module.pt", tmp_path))["input"]
    assert isinstance(plain, np.ndarray) and isinstance(boxed, torch.Tensor)
    assert plain.tobytes() == boxed.view(torch.int16).numpy().tobytes()
    assert digest(plain) == digest(boxed) is not None
    # fp8 the same way (torch reads fp8 files itself; an ml_dtypes array may come from a .npy)
    q = (torch.randn(16, generator=g) * 8).to(torch.float8_e4m3fn)
    assert digest(q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)) == digest(q) is not None
