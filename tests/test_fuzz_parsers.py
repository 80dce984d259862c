"""Property-based fuzzing of the dump parsers, through ``ingest``.

Random bytes, mutated valid files and random JSON structures are written
into a fresh dump folder as a ``.npy`` file, a ``.safetensors`` file, an
msprobe ``dump.json`` or a ``.bin`` sidecar, and ingested.  The property:
either a session is created, or ``IngestError`` is raised whose message
names the fuzzed file (by its path inside the dump) and the database is
unchanged.  Any other exception is a bug.
"""

from __future__ import annotations

import io
import itertools
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from precision_lab.services.ingest import IngestError, ingest

pytestmark = pytest.mark.slow  # hundreds of generated dumps, each ingested

FUZZ = settings(max_examples=80, deadline=None, database=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
_n = itertools.count()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from precision_lab.store import Store, close_all

    root = tmp_path_factory.mktemp("fuzz")
    store = Store(root / "fuzz.duckdb")
    yield root, store
    close_all()


def _sessions(store) -> int:
    return store.sql("SELECT count(*) FROM sessions").fetchone()[0]


def check(lab, write, names: tuple[str, ...]) -> None:
    """Build a dump with ``write(folder)``, ingest it: a session, or an IngestError naming one of ``names``."""
    root, store = lab
    d = root / f"d{next(_n)}"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.arange(4, dtype=np.float32))  # read first: a half session would show
    write(d)
    before = _sessions(store)
    try:
        name = ingest(d, store=store)
    except IngestError as e:
        msg = str(e)
        head = msg.split(" (in dump ")[0]
        assert any(n in head for n in names), f"the message does not name {names}: {msg!r}"
        assert not head.startswith(str(d)), f"the file is named by an absolute path: {msg!r}"
        assert _sessions(store) == before, "a refused ingest changed the database"
        return
    assert _sessions(store) == before + 1
    store.delete_session(name)


# ---- building blocks ---------------------------------------------------------------------

_dims = st.one_of(st.integers(0, 6), st.integers(-3, 2 ** 70), st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63, 2 ** 64]))
_shape = st.lists(_dims, max_size=4)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True),
                       st.text(max_size=12))
_json = st.recursive(_json_leaf, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                     max_leaves=20)


def _mutate(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for kind, pos, val in edits:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= val or 1
        elif kind == "cut":
            del b[i:]
        elif kind == "insert":
            b[i:i] = bytes([val])
        else:
            del b[i]
    return bytes(b)


_edits = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 1 << 16),
                            st.integers(0, 255)), min_size=1, max_size=4)


# ---- .npy ----------------------------------------------------------------------------------

_DESCRS = ["<f4", "<f2", ">f8", "|u1", "<i8", "|b1", "<c8", "|O", "<U3", "|V4", "<q99", "bogus",
           "[('a', '<f4')]", "[('a', '|O')]", "<M8[s]"]


@st.composite
def npy_files(draw):
    kind = draw(st.sampled_from(["random", "header", "mutated"]))
    if kind == "random":
        return draw(st.sampled_from([b"", b"\x93NUMPY"])) + draw(st.binary(max_size=300))
    if kind == "mutated":
        arr = np.arange(draw(st.integers(0, 40)), dtype=draw(st.sampled_from(["<f4", "<f2", "<i8", "|u1"])))
        buf = io.BytesIO()
        np.save(buf, arr)
        return _mutate(buf.getvalue(), draw(_edits))
    descr = draw(st.sampled_from(_DESCRS))
    descr_text = descr if descr.startswith("[") else repr(descr)
    fortran = draw(st.sampled_from(["False", "True", "'yes'", "None"]))
    shape = draw(_shape)
    shape_text = "(" + "".join(f"{s}, " for s in shape) + ")"
    header = draw(st.sampled_from([
        f"{{'descr': {descr_text}, 'fortran_order': {fortran}, 'shape': {shape_text}, }}",
        f"{{'descr': {descr_text}, 'shape': {shape_text}}}",
        draw(st.text(max_size=60)),
    ]))
    header += " " * draw(st.sampled_from([0, 10, 12_000]))
    version = draw(st.sampled_from([1, 2, 3, 7]))
    h = header.encode("utf-8") + b"\n"
    length = struct.pack("<H", len(h) % 65536) if version == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([version, 0]) + length + h + draw(st.binary(max_size=64))


@FUZZ
@given(data=npy_files())
@example(data=b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0) + b"{'descr'")
@example(data=b"\x93NUMPY\x01\x00" + struct.pack("<H", 60) + b"{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }")
def test_npy_reader(lab, data):
    check(lab, lambda d: (d / "x.output.0.npy").write_bytes(data), ("x.output.0.npy",))


# ---- .safetensors header ---------------------------------------------------------------------

_ST_DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "C64", "F99", 3]


@st.composite
def safetensors_files(draw):
    kind = draw(st.sampled_from(["random", "header", "json"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "json":
        header = json.dumps(draw(_json)).encode()
    else:
        entries = {}
        for i in range(draw(st.integers(0, 4))):
            e = {"dtype": draw(st.sampled_from(_ST_DTYPES)), "shape": draw(_shape),
                 "data_offsets": draw(st.lists(st.integers(-8, 2 ** 66), min_size=0, max_size=3))}
            if draw(st.booleans()):  # a consistent entry
                n = 4 * int(np.prod([max(0, min(s, 4)) for s in e["shape"]], dtype=object) or 1)
                e = {"dtype": "F32", "shape": [max(0, min(s, 4)) for s in e["shape"]],
                     "data_offsets": [0, n if e["shape"] else 4]}
            entries[draw(st.sampled_from([f"t{i}", "__metadata__", ""]))] = e
        header = json.dumps(entries).encode()
    data = draw(st.binary(max_size=128))
    length = draw(st.sampled_from([len(header), len(header), len(header) + 1, 0, 2 ** 64 - 1,
                                   draw(st.integers(0, 2 ** 32))]))
    return length.to_bytes(8, "little") + header + data


@FUZZ
@given(data=safetensors_files())
@example(data=(2 ** 64 - 1).to_bytes(8, "little") + b"{}")
def test_safetensors_header_reader(lab, data):
    check(lab, lambda d: (d / "w.safetensors").write_bytes(data), ("w.safetensors",))


# ---- msprobe dump.json ------------------------------------------------------------------------

_KEYS = st.one_of(st.sampled_from(["Functional.linear.0.forward", "Tensor.__add__.1.backward",
                                   "Module.blocks.0.fc1.Linear.forward.0",
                                   "Module.head.Linear.parameters_grad.0", "Torch.matmul.2.forward"]),
                  st.text(max_size=20))
_DATA_NAMES = st.one_of(st.none(), st.sampled_from(["t.pt", "missing.pt", "../../../../etc/passwd", "/etc/passwd",
                                                    ".", "..", "../dump.json", "C:\\x.pt", ""]),
                        st.text(max_size=15), st.integers())


@st.composite
def tensor_entries(draw):
    e = {"type": draw(st.sampled_from(["torch.Tensor", "numpy.ndarray", "int", "torch.Tensor"])),
         "dtype": draw(st.sampled_from(["torch.float16", "torch.float32", "torch.bfloat16", "torch.int64",
                                        "bogus", None])),
         "shape": draw(st.one_of(st.just([2, 3]), _shape, _json_leaf))}
    for k in ("Max", "Min", "Mean", "Norm"):
        if draw(st.booleans()):
            e[k] = draw(st.one_of(st.floats(allow_nan=True), st.integers(-(10 ** 400), 10 ** 400), _json_leaf))
    dn = draw(_DATA_NAMES)
    if dn is not None:
        e["data_name"] = dn
    return e


_slot = st.one_of(tensor_entries(), _json)
_entry = st.one_of(
    st.fixed_dictionaries({}, optional={"input_args": st.lists(st.one_of(_slot, st.lists(_slot, max_size=2)),
                                                               max_size=3),
                                        "input_kwargs": st.one_of(st.dictionaries(st.text(max_size=5), _slot,
                                                                                  max_size=2), _json_leaf),
                                        "output": st.one_of(st.lists(_slot, max_size=2), _slot),
                                        "parameters": st.dictionaries(st.text(max_size=5), _slot, max_size=2),
                                        "input": st.lists(_slot, max_size=2)}),
    _json)


@st.composite
def dump_jsons(draw):
    kind = draw(st.sampled_from(["structured", "structured", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        doc = draw(st.one_of(_json, st.fixed_dictionaries({"data": _json})))
    else:
        doc = {"task": "tensor", "level": "mix", "data": draw(st.dictionaries(_KEYS, _entry, max_size=4))}
    return json.dumps(doc).encode()


def _msprobe(d, text: bytes) -> None:
    import torch

    rd = d / "step0" / "rank0"
    (rd / "dump_tensor_data").mkdir(parents=True)
    torch.save(torch.ones(2, 3, dtype=torch.float16), rd / "dump_tensor_data" / "t.pt")
    (rd / "dump.json").write_bytes(text)


@FUZZ
@given(text=dump_jsons())
@example(text=b'{"data": {"Functional.linear.0.forward": {"input_kwargs": 1}}}')
@example(text=b'{"data": {"Module.head.Linear.parameters_grad.0": {"": 1}}}')
@example(text=b'{"data": {"Functional.linear.0.forward": {"output": 1}}}')
@example(text=b'{"task": "tensor", "level": "mix", "data": {"Functional.linear.0.forward": {"input_args": [{"type": '
              b'"torch.Tensor", "dtype": "torch.float16", "shape": [0, 18446744073709551616]}]}}}')
@example(text=b'{"data": {"Functional.linear.0.forward": {"input_args": [{"type": "torch.Tensor", '
              b'"dtype": "torch.float16", "shape": [2, 3], "Max": ' + b"9" * 5000 + b"}]}}}")
def test_msprobe_dump_json_reader(lab, text):
    # a data_name may lead the reader to another file of the dump: naming that file is naming the problem
    check(lab, lambda d: _msprobe(d, text), ("dump.json", "dump_tensor_data", "step0/"))


# ---- .bin sidecars -----------------------------------------------------------------------------

_BIN_DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8", "uint64", "bool", "complex64", "object",
               "V4", "U2", "float13", "torch.float16", "[('a', '<f4')]", "", 7]


@st.composite
def sidecars(draw):
    kind = draw(st.sampled_from(["structured", "structured", "json", "bytes"]))
    if kind == "bytes":
        text = draw(st.binary(max_size=120))
    elif kind == "json":
        text = json.dumps(draw(_json)).encode()
    else:
        meta = {"dtype": draw(st.sampled_from(_BIN_DTYPES)), "shape": draw(st.one_of(_shape, _json_leaf))}
        if draw(st.booleans()):
            meta["byteorder"] = draw(st.sampled_from(["little", "big", "middle", None, 1]))
        if draw(st.booleans()):
            meta["offset"] = draw(st.one_of(st.integers(-4, 2 ** 66), _json_leaf))
        for k in list(meta):
            if draw(st.integers(0, 9)) == 0:
                del meta[k]
        text = json.dumps(meta).encode()
    return text, draw(st.binary(max_size=64))


@FUZZ
@given(files=sidecars(), name=st.sampled_from(["z.json", "z.bin.json"]))
@example(files=(b'{"dtype": "object", "shape": [2]}', bytes(16)), name="z.json")
@example(files=(b'{"dtype": "float32", "shape": [4], "offset": ' + b"9" * 5000 + b"}", bytes(16)), name="z.json")
def test_bin_sidecar_reader(lab, files, name):
    text, raw = files

    def write(d):
        (d / "z.bin").write_bytes(raw)
        (d / name).write_bytes(text)

    check(lab, write, (name, "z.bin"))
