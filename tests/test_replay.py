"""Op replay from tensor-mode dumps: reproduces the dumped output, fp32 agrees with float64, fixes apply."""

import json
import math
import re

import numpy as np
import pytest
from pathlib import Path
import torch
from typer.testing import CliRunner

from precision_lab.fixes.replay import REPLAY_OPS, ReplayError, canonical_op, replay
from precision_lab.services.replay import REPRODUCE_ULPS, replay_op, replayable_ops

FIXTURES = __import__("tests.conftest", fromlist=["FIXTURES"]).FIXTURES
F16 = np.finfo(np.float16)


def _fp16_ulp(x):
    """fp16's spacing at each |x|, from numpy (subnormal spacing below the smallest normal)."""
    return torch.from_numpy(np.spacing(np.abs(x.numpy()).astype(np.float16)).astype(np.float64))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    tmp = tmp_path_factory.mktemp("replay")
    store = Store(tmp / "replay.duckdb")
    with store.held():  # the file opened once for the reads of the ingests, not once per read
        kept = ingest([FIXTURES / "tensor_mix_fp16"], store=store, keep_tensors=True, session="kept")
        dump = _overflow_dump(tmp / "ovf_dump")
        files = ingest([dump], store=store, session="from-files")
    yield store, kept, files, tmp / "replay.duckdb"
    close_all()


def _overflow_dump(root):
    """A tiny msprobe tensor-mode dump whose fp16 linear overflows (4 x 200 x 100 = 80,000 > 65,504)."""
    d = root / "step0" / "rank0"
    (d / "dump_tensor_data").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    x = (200 + torch.rand(2, 4, generator=g)).half()
    w = (100 + torch.rand(3, 4, generator=g)).half()
    b = torch.zeros(3).half()
    y = torch.nn.functional.linear(x, w, b)
    assert torch.isinf(y).any()
    logits = (torch.rand(2, 6, generator=g) * 30).half()
    sm = torch.softmax(logits, dim=-1)

    def desc(t, name):
        torch.save(t, d / "dump_tensor_data" / name)
        tf = t.float()
        return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": float(tf.max()),
                "Min": float(tf.min()), "Mean": float(tf.mean()), "Norm": float(tf.norm()), "requires_grad": False,
                "data_name": name}

    k = "Functional.linear.0.forward"
    s = "Functional.softmax.0.forward"
    data = {
        k: {"input_args": [desc(x, f"{k}.input.0.pt"), desc(w, f"{k}.input.1.pt"), desc(b, f"{k}.input.2.pt")],
            "input_kwargs": {}, "output": [desc(y, f"{k}.output.0.pt")]},
        s: {"input_args": [desc(logits, f"{s}.input.0.pt")], "input_kwargs": {"dim": {"type": "int", "value": -1}},
            "output": [desc(sm, f"{s}.output.0.pt")]},
    }
    # msprobe writes bare Infinity tokens, as json.dumps does
    text = json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": str(d),
                       "data": data})
    (d / "dump.json").write_text(text)
    return root


def _np64(t):
    return t.detach().double().numpy()


def _np_reference(kind, args):
    a = [(_np64(x) if isinstance(x, torch.Tensor) else x) for x in args]
    if kind == "layer_norm":
        x, shape, w, b, eps = a
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w + b
    if kind == "linear":
        return a[0] @ a[1].T + (a[2] if len(a) > 2 and a[2] is not None else 0)
    if kind == "matmul":
        return a[0] @ a[1]
    if kind == "div":
        return a[0] / a[1]
    if kind == "add":
        return a[0] + a[1]
    if kind == "softmax":
        e = np.exp(a[0] - a[0].max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == "gelu":
        x = a[0]
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    raise AssertionError(kind)


def _args_of(store, session, op):
    """The op's inputs as stored (kept tensors), for the independent computation."""
    from precision_lab.services.replay import _assemble, _load_tensor, _pick_run, _scalar_args
    from precision_lab.store.rows import NamedRecord, records_as

    info = store.session(session)
    run = _pick_run(store, info, None)
    recs = records_as(NamedRecord, store.sql("SELECT * FROM tensors WHERE run_id = ? AND op = ? ORDER BY rid",
                                             [run.run_id, op]))
    tensors = {(r.role, r.index): _load_tensor(store, run, r) for r in recs}
    pos, kw, _ = _scalar_args(run, op, recs)
    return _assemble(canonical_op(recs[0].op_type), tensors, pos, kw)


@pytest.mark.parametrize("op, kind", [
    ("Functional.layer_norm.0.forward", "layer_norm"),
    ("Functional.linear.0.forward", "linear"),
    ("Torch.matmul.0.forward", "matmul"),
    ("Tensor.__truediv__.0.forward", "div"),
    ("Functional.softmax.0.forward", "softmax"),
    ("Functional.gelu.0.forward", "gelu"),
    ("Tensor.__add__.0.forward", "add"),
])
def test_replay_reproduces_dump_and_fp32_matches_float64(lab, op, kind):
    store, kept, _, _ = lab
    res = replay_op(store, kept, op)
    assert res.replay_as == kind and res.cand_format == "fp16"
    same = res.comparisons["candidate vs dumped"]
    # the dump was recorded on another CPU: the same fp16 kernel may round a sum differently there
    assert same.nonfinite_introduced == 0 and same.max_ulp_err <= REPRODUCE_ULPS and res.reproduces_dump
    assert res.dump_match == ("bit-exact" if same.max_abs_err == 0 else f"within {math.ceil(same.max_ulp_err)} ulp"
                              + ("s" if math.ceil(same.max_ulp_err) > 1 else ""))
    args, kwargs = _args_of(store, kept, op)
    if kind == "layer_norm":
        assert tuple(args[1]) == (32,) and args[4] == pytest.approx(1e-5)  # read from dump.json
    expect = _np_reference(kind, args)
    np.testing.assert_allclose(res.outputs["fp32"].double().numpy(), expect, rtol=1e-5, atol=1e-5)
    # the dumped fp16 output differs from fp32 by about fp16's rounding
    assert res.comparisons["dumped vs fp32"].verdict == "expected"


def test_module_entry_uses_its_parameters(lab):
    store, kept, _, _ = lab
    res = replay_op(store, kept, "Module.blocks.0.ln1.LayerNorm.forward.0")
    assert res.replay_as == "layer_norm" and res.comparisons["candidate vs dumped"].max_abs_err == 0
    assert any("eps 1e-5" in n for n in res.notes)
    res = replay_op(store, kept, "Module.blocks.0.fc1.Linear.forward.0", fixes="keep-fp32:Module.blocks.0.fc1.*")
    assert res.outputs["fixed"].dtype == torch.float32
    assert res.comparisons["fixed vs fp32"].max_abs_err == 0


def test_overflow_replayed_from_files_and_fixed(lab):
    store, _, files, _ = lab
    op = "Functional.linear.0.forward"
    res = replay_op(store, files, op, fixes=f"keep-fp32:{op}")
    assert torch.isinf(res.outputs["dumped"]).any() and torch.isinf(res.outputs["candidate"]).any()
    cand, dumped = res.outputs["candidate"], res.outputs["dumped"]
    assert res.reproduces_dump and torch.equal(torch.isinf(cand), torch.isinf(dumped))
    fin = torch.isfinite(dumped)
    ulp = _fp16_ulp(dumped[fin].double())  # independent: spacing of fp16 at each dumped value
    assert ((cand[fin].double() - dumped[fin].double()).abs() <= REPRODUCE_ULPS * ulp).all()
    assert torch.isfinite(res.outputs["fixed"]).all() and res.fixed_is_finite
    args, _ = _args_of(store, files, op)
    expect = _np_reference("linear", args)
    assert np.abs(expect).max() > float(F16.max)
    np.testing.assert_allclose(res.outputs["fixed"].double().numpy(), expect, rtol=1e-6)
    bf = replay_op(store, files, op, fixes="use-bf16")
    assert bf.outputs["fixed"].dtype == torch.bfloat16 and bf.fixed_is_finite
    rows = {r["output"]: r for r in res.rows()}
    assert rows["candidate"]["inf"] > 0 and rows["fixed"]["inf"] == 0
    assert rows["candidate"]["verdict_vs_fp32"] == "nonfinite"


def test_replay_softmax_dim_from_kwargs(lab):
    store, _, files, _ = lab
    res = replay_op(store, files, "Functional.softmax.0.forward")
    assert res.comparisons["candidate vs dumped"].max_abs_err == 0
    s = res.outputs["fp32"].sum(-1)
    np.testing.assert_allclose(s.numpy(), 1.0, rtol=1e-6)


def test_replay_errors(lab, tmp_path):
    from tests.conftest import SAMPLES
    from precision_lab.services.ingest import ingest

    store, kept, files, _ = lab
    with pytest.raises(ReplayError, match=r"has no forward op 'Nope.0.forward'"):
        replay_op(store, kept, "Nope.0.forward")
    with pytest.raises(ReplayError, match=r"has type 'pow', which replay does not know"):
        replay_op(store, kept, "Tensor.pow.0.forward")
    stats_only = ingest([SAMPLES / "stat_mix_fp16_inner_ovf"], store=store, session="stats-only")
    op = replayable_ops(store, stats_only)[0].op
    with pytest.raises(ReplayError, match=r"only its statistics were dumped or kept"):
        replay_op(store, stats_only, op)
    with pytest.raises(ReplayError, match=r"cannot be replayed; replayable: linear"):
        replay("conv2d", [torch.zeros(1)])


def test_replay_function_and_quantise():
    from precision_lab.fixes.policy import PrecisionPolicy, QuantConfig

    x = torch.tensor([0.0975, 0.0, -0.05], dtype=torch.float16)
    pol = PrecisionPolicy("q", "fp16", quant=QuantConfig("fp8_e5m2", "tensor", "fp16"))
    out = replay("FakeQuant", [x], cand_format="fp16", policy=pol, fixes="scale-fp32")
    assert torch.isnan(out.candidate).any()  # 0 x inf with an fp16 scale
    assert torch.isfinite(out.fixed).all()
    assert torch.equal(out.fp32, x.float())  # the unquantised value is the reference
    assert set(REPLAY_OPS) >= {"linear", "matmul", "layer_norm", "rms_norm", "softmax", "gelu", "silu", "add",
                               "mul", "div", "quantise"}
    assert canonical_op("__truediv__") == "div" and canonical_op("LayerNorm") == "layer_norm"


def test_cli_replay(lab):
    from precision_lab.cli import app

    store, _, files, path = lab
    runner = CliRunner()
    res = runner.invoke(app, ["replay", "--session", files, "--db", str(path)])
    assert res.exit_code == 0 and "Functional.linear.0.forward  (linear -> linear)  non-finite" in res.output
    res = runner.invoke(app, ["replay", "--session", files, "--op", "Functional.linear.0.forward", "--fix",
                              "keep-fp32:Functional.linear.0.forward", "--db", str(path)])
    assert res.exit_code == 0, res.output
    assert re.search(r"replay reproduces the dumped output (bit-exact|within \d ulps?)\n", res.output), res.output
    assert "fixed" in res.output
    res = runner.invoke(app, ["replay", "--session", files, "--op", "Functional.linear.0.forward", "--fix",
                              "stable-softmax", "--db", str(path)])
    assert res.exit_code == 1  # that fix does not remove the overflow


@pytest.mark.parametrize("op_type", ["rms_norm", "silu", "mul", "sub", "relu", "exp"])
def test_replay_more_ops_against_float64(op_type):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g).half()
    y = torch.randn(4, 16, generator=g).half()
    w = torch.rand(16, generator=g).half()
    xn, yn, wn = _np64(x), _np64(y), _np64(w)
    if op_type == "rms_norm":
        args = [x, (16,), w, 1e-6]
        expect = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6) * wn
    elif op_type == "silu":
        args, expect = [x], xn / (1 + np.exp(-xn))
    elif op_type == "mul":
        args, expect = [x, y], xn * yn
    elif op_type == "sub":
        args, expect = [x, y], xn - yn
    elif op_type == "relu":
        args, expect = [x], np.maximum(xn, 0)
    else:
        args, expect = [x], np.exp(xn)
    out = replay(op_type, args, cand_format="fp16", fixes="use-bf16")
    np.testing.assert_allclose(out.fp32.double().numpy(), expect, rtol=1e-5, atol=1e-6)
    assert out.candidate.dtype == torch.float16 and out.fixed.dtype == torch.bfloat16
    # fp16 and bf16 replays stay within a few of their own rounding units of float64
    for key, eps in (("candidate", 2.0 ** -10), ("fixed", 2.0 ** -7)):
        np.testing.assert_allclose(getattr(out, key).double().numpy(), expect, rtol=4 * eps, atol=4 * eps)


def _flip_data_byte(path):
    """Flip the lowest bit of the first byte of a torch file's tensor data (a stored zip member): still a valid
    number, so only the member's CRC-32 can tell."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl"))
    raw = bytearray(path.read_bytes())
    head = raw[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_replay_refuses_a_tensor_file_damaged_after_ingest(tmp_path):
    """A byte flipped in an ingested msprobe tensor: replay names the file (CLI: one error line, exit 2)."""
    from precision_lab.cli import app
    from precision_lab.readers import ReadError
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    dump = _overflow_dump(tmp_path / "dump")
    db = tmp_path / "r.duckdb"
    store = Store(db)
    try:
        name = ingest([dump], store=store, session="s")
        op = "Functional.linear.0.forward"
        before = replay_op(store, name, op).outputs["dumped"]
        rel = f"step0/rank0/dump_tensor_data/{op}.input.0.pt"
        _flip_data_byte(dump / rel)
        # torch itself reads the damaged file without complaint, as other numbers
        x = torch.load(dump / rel, weights_only=True)
        assert x.shape == (2, 4) and torch.isfinite(x).all()
        with pytest.raises(ReadError) as e:
            replay_op(store, name, op)
        assert str(e.value).startswith(f"{rel}: damaged .pt archive") and "CRC" in str(e.value)
        assert "\n" not in str(e.value)
        res = CliRunner().invoke(app, ["replay", "--session", name, "--op", op, "--db", str(db)])
        assert res.exit_code == 2 and res.output.strip().splitlines() == [f"error: {e.value}"]
        assert torch.equal(replay_op(store, name, "Functional.softmax.0.forward").outputs["dumped"].isinf(),
                           torch.zeros(2, 6, dtype=torch.bool))  # the other op's files are intact
        assert torch.isinf(before).any()
    finally:
        close_all()


def test_replay_refuses_a_tensor_file_whose_shape_changed(tmp_path):
    from precision_lab.readers import ReadError
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    dump = _overflow_dump(tmp_path / "dump")
    store = Store(tmp_path / "r.duckdb")
    try:
        name = ingest([dump], store=store, session="s")
        op = "Functional.linear.0.forward"
        rel = f"step0/rank0/dump_tensor_data/{op}.input.2.pt"
        torch.save(torch.zeros(5).half(), dump / rel)
        with pytest.raises(ReadError, match=re.escape(f"{rel}: holds a tensor of shape [5] where the session "
                                                      f"recorded [3]")):
            replay_op(store, name, op)
    finally:
        close_all()


def test_replay_from_a_generic_npy_folder(tmp_path):
    """Files of a generic dump are read through the same loader as msprobe's (no --keep-tensors needed)."""
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    d = tmp_path / "gen"
    d.mkdir()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 8)).astype(np.float16)
    w = rng.standard_normal((4, 8)).astype(np.float16)
    b = rng.standard_normal(4).astype(np.float16)
    y = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    for role, a in (("input.0", x), ("input.1", w), ("input.2", b), ("output.0", y)):
        np.save(d / f"linear.{role}.npy", a)
    store = Store(tmp_path / "g.duckdb")
    try:
        name = ingest([d], store=store, session="g")
        res = replay_op(store, name, "linear")
        expect = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
        np.testing.assert_allclose(res.outputs["fp32"].double().numpy(), expect, rtol=1e-6, atol=1e-6)
        assert res.outputs["dumped"].dtype == torch.float16 and res.reproduces_dump
    finally:
        close_all()


def test_replay_refuses_an_npy_whose_numbers_changed(tmp_path):
    """.npy has no checksum: a value changed after ingest is caught by the exact statistics stored at ingest."""
    from precision_lab.readers import ReadError
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    d = tmp_path / "gen"
    d.mkdir()
    x = np.float16([[1.0, -2.0, 0.5, 3.0]])
    w = np.float16([[0.25, 0.5, -1.0, 2.0]])
    np.save(d / "linear.input.0.npy", x)
    np.save(d / "linear.input.1.npy", w)
    np.save(d / "linear.output.0.npy", (x.astype(np.float32) @ w.T.astype(np.float32)).astype(np.float16))
    store = Store(tmp_path / "g.duckdb")
    try:
        name = ingest([d], store=store, session="g")
        assert replay_op(store, name, "linear").reproduces_dump
        x[0, 3] = 7.0  # a new maximum, same shape and dtype
        np.save(d / "linear.input.0.npy", x)
        with pytest.raises(ReadError, match=re.escape("linear.input.0.npy: its max is 7.0 where the session "
                                                      "recorded 3.0 for linear.input.0; the dump changed")):
            replay_op(store, name, "linear")
    finally:
        close_all()


def test_cli_replay_reads_within_the_configured_limits(tmp_path, monkeypatch):
    """The CLI replays within the settings' limits, as ingest reads: a tensor larger than max_tensor_mb is refused."""
    from precision_lab.cli import app
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    d = tmp_path / "gen"
    d.mkdir()
    x = np.ones((600, 1000), np.float16)  # 1.2 MB: over a 1 MiB limit
    np.save(d / "relu.input.0.npy", x)
    np.save(d / "relu.output.0.npy", x)
    db = tmp_path / "g.duckdb"
    store = Store(db)
    try:
        name = ingest([d], store=store, session="g")
    finally:
        close_all()
    ok = CliRunner().invoke(app, ["replay", "--session", name, "--op", "relu", "--db", str(db)])
    assert ok.exit_code == 0, ok.output
    monkeypatch.setenv("PRECISION_LAB_MAX_TENSOR_MB", "1")
    res = CliRunner().invoke(app, ["replay", "--session", name, "--op", "relu", "--db", str(db)])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        "error: relu.input.0.npy: a tensor of shape [600, 1000] needs 1200000 bytes, more than the limit of 1048576 "
        "bytes (max_tensor_mb)"]


def test_imported_session_never_reads_its_source_folder(lab, tmp_path):
    """A shared archive's run sources name folders of the machine that exported it.  Imported, replay reads
    none of them, even where that folder exists here: a crafted archive could name any local dump."""
    from precision_lab.services.share import export_session, import_session
    from precision_lab.store import Store
    from precision_lab.store.queries import rows

    store, _, _, _ = lab
    op = "Functional.linear.0.forward"
    assert replay_op(store, "from-files", op).reproduces_dump  # the dump folder is here and readable
    export_session(store, "from-files", tmp_path / "s.zip")
    other = Store(tmp_path / "other.duckdb")
    imp = import_session(other, tmp_path / "s.zip")
    before = rows(store, "SELECT r.source FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                  ["from-files"])
    after = rows(other, "SELECT source FROM runs WHERE session_id = ?", [imp.session_id])
    # the archive names each folder by its name (no path of the sharer's machine), read here as text only
    assert sorted(r["source"] for r in after) == sorted("shared archive: " + Path(r["source"]).name for r in before)
    with pytest.raises(ReplayError, match="not available"):
        replay_op(other, imp.session, op)
