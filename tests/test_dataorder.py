"""Order recovered from the data: digests and the topological order they give."""

import dataclasses

import numpy as np
import pytest
import torch

from precision_lab.readers.dataorder import Hint, digest, order_from_data, settle


def test_digest_tells_tensors_apart_by_bytes_dtype_and_shape():
    a = np.arange(6, dtype=np.float32)
    assert digest(a) == digest(a.copy()) == digest(torch.from_numpy(a.copy()))
    assert digest(a) != digest(a.astype(np.float16))  # same values, another dtype
    assert digest(a) != digest(a.reshape(2, 3))  # same bytes, another shape
    b = a.copy()
    b[3] = np.nextafter(b[3], np.float32(10))  # one ulp apart
    assert digest(a) != digest(b)
    assert digest(torch.arange(6.0).bfloat16()) is not None


@pytest.mark.parametrize("t", [np.zeros(8, np.float32), np.ones((2, 4)), np.float32(3.0), np.arange(1.0)])
def test_tensors_that_many_ops_share_give_no_digest(t):
    assert digest(t) is None


def test_all_nan_and_all_inf_tensors_keep_their_digest():
    assert digest(np.full(8, np.nan, np.float16)) is not None
    assert digest(np.full(8, np.inf, np.float32)) is not None


def _entries(calls):
    """(op, role, digest) for ops given as op -> (input array, output array)."""
    out = []
    for op, (x, y) in calls.items():
        out += [(op, "input", digest(x)), (op, "output", digest(y))]
    return out


def test_a_chain_given_backwards_by_name_comes_out_in_call_order():
    rng = np.random.default_rng(0)
    x0, x1, x2, x3 = (rng.standard_normal(4).astype(np.float32) for _ in range(4))
    calls = {"z_last": (x2, x3), "m_mid": (x1, x2), "a_first": (x0, x1)}
    got = order_from_data(reversed(_entries(calls)))
    assert [o for o, _ in sorted(got.rank.items(), key=lambda kv: kv[1])] == ["a_first", "m_mid", "z_last"]
    assert got.edges == 2


def test_modules_share_tensors_with_the_ops_inside_them_without_edges():
    rng = np.random.default_rng(1)
    x, h, y, z = (rng.standard_normal(4).astype(np.float32) for _ in range(4))
    calls = {"head": (y, z), "block": (x, y), "block.fc1": (x, h), "block.fc2": (h, y)}
    got = order_from_data(_entries(calls))
    r = got.rank
    assert r["block"] < r["block.fc1"] < r["block.fc2"] < r["head"]


def test_no_links_means_no_order_and_a_cycle_still_gives_one():
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(4).astype(np.float32) for _ in range(2))
    assert order_from_data(_entries({"p": (a, a + 1), "q": (b, b + 1)})) is None
    got = order_from_data(_entries({"p": (a, b), "q": (b, a)}))  # each feeds the other: broken at the first given
    assert got.rank == {"p": 0, "q": 1}


def test_all_nan_links_wait_behind_real_ones_and_modules_come_before_their_ops():
    """After an overflow every tensor may be all-NaN: such links are weak, so an op of a later branch that only
    an all-NaN tensor ties to the failing one is not placed first because its name sorts first."""
    rng = np.random.default_rng(3)
    x, h, y = (rng.standard_normal((2, 4)).astype(np.float16) for _ in range(3))
    nan = np.full((2, 4), np.nan, np.float16)
    assert digest(nan).weak and not digest(x).weak
    calls = {
        "a_decoder.cross": (nan, y),  # reads the encoder's (all-NaN) output; sorts first by name
        "a_decoder.cross.k": (nan, h),
        "z_encoder.fc": (x, nan),  # the overflow
    }
    got = order_from_data(_entries(calls))
    r = got.rank
    assert r["z_encoder.fc"] < r["a_decoder.cross"] < r["a_decoder.cross.k"]


# ---- settle: every source of order together ----------------------------------------------------------


def _chain(n=4, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(6).astype(np.float32) for _ in range(n)]


def _hints(calls, **per_op):
    """Hints for ops given as op -> (input array or None, output array); ``per_op``: field -> {op: value}."""
    out = []
    for op, (x, y) in calls.items():
        extra = {k: v[op] for k, v in per_op.items() if op in v}
        if x is not None:
            out.append(Hint(op, "input", digest(x), **extra))
        out.append(Hint(op, "output", digest(y), **extra))
    return out


def _ranked(got):
    return [o for o, _ in sorted(got.rank.items(), key=lambda kv: kv[1])]


def test_a_module_list_in_call_or_completion_order_is_recognised_and_said():
    x0, h, y, z = _chain()
    calls = {"block": (x0, y), "block.fc1": (x0, h), "block.fc2": (h, y), "head": (y, z)}
    call = {"block": 0, "block.fc1": 1, "block.fc2": 2, "head": 3}
    done = {"block.fc1": 0, "block.fc2": 1, "block": 2, "head": 3}
    got = settle(_hints(calls, listed=call), listed_from="manifest.json")
    assert got.kind == "execution" and got.list_order == "call" and "call order" in got.note
    assert _ranked(got) == ["block", "block.fc1", "block.fc2", "head"]
    got = settle(_hints(calls, listed=done), listed_from="order.json")
    assert got.list_order == "completion" and "completion order" in got.note
    assert _ranked(got) == ["block.fc1", "block.fc2", "block", "head"]


def test_a_partial_list_is_completed_by_the_data_not_by_the_names():
    x0, x1, x2, x3 = _chain()
    # "a_late" reads what "m_mid" wrote: by name it would come first
    calls = {"z_first": (x0, x1), "m_mid": (x1, x2), "a_late": (x2, x3)}
    got = settle(_hints(calls, listed={"z_first": 0, "m_mid": 1}), listed_from="manifest.json")
    assert _ranked(got) == ["z_first", "m_mid", "a_late"]
    assert "1 op(s) it does not list placed by the data" in got.note


def test_file_time_ties_are_broken_by_the_data_and_the_note_says_what_is_certain():
    x0, x1, x2, x3 = _chain()
    calls = {"z_first": (x0, x1), "m_mid": (x1, x2), "a_late": (x2, x3), "b_after": (np.float32([5, 6, 7]), x0[:3])}
    # the first three share one coarse time, the fourth came later
    got = settle(_hints(calls, tick={"z_first": 0, "m_mid": 0, "a_late": 0, "b_after": 1}))
    assert _ranked(got) == ["z_first", "m_mid", "a_late", "b_after"]
    assert got.kind == "data" and "certain between the 2 distinct times" in got.note
    assert "3 op(s) share a time" in got.note and "2 output(s) bit-identical" in got.note


def test_the_root_under_any_name_holds_every_op():
    x0, h, y, z = _chain()
    # the root saved as its class name: its input is its first child's, its output its last child's
    calls = {"Net": (x0, z), "enc": (x0, h), "enc.fc": (x0, h), "dec": (h, y), "head": (y, z)}
    got = settle(_hints(calls))
    assert _ranked(got)[0] == "Net"
    assert {o: got.parents.get(o) for o in ("enc", "enc.fc", "dec", "head")} == dict.fromkeys(
        ("enc", "enc.fc", "dec", "head"), "Net")


def test_without_inputs_containers_go_first_then_the_fewest_non_finite_values():
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(8).astype(np.float16), rng.standard_normal(8).astype(np.float16)
    a[0] = np.inf
    nan = np.full(8, np.nan, np.float16)
    # outputs only, no times: "lm_head" sorts first by name, but the overflow holds fewer non-finite values
    calls = {"lm_head": (None, nan), "model": (None, nan), "model.mlp": (None, a), "model.mlp.down": (None, a),
             "model.up": (None, b)}
    spread = {"lm_head": 1.0, "model": 1.0, "model.mlp": 1 / 8, "model.mlp.down": 1 / 8, "model.up": 0.0}
    got = settle([dataclasses.replace(h, spread=spread[h.op]) for h in _hints(calls)])
    r = _ranked(got)
    assert got.kind == "name" and "order unknown" in got.note
    assert r.index("model") < r.index("model.mlp") < r.index("model.mlp.down") < r.index("lm_head")


def test_backward_ops_go_after_the_forward_pass_in_the_order_autograd_runs_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    for name, mod in (("zin", torch.nn.Linear(8, 8)), ("act", torch.nn.ReLU()), ("mid", torch.nn.Linear(8, 8)),
                      ("head", torch.nn.Linear(8, 4))):
        model.add_module(name, mod)
    fired, saved = [], []  # what the hooks saw, in the order they ran: the order to recover

    def fwd(name):
        def hook(_m, args, out):
            fired.append(name)
            saved.extend([(name, "input", args[0]), (name, "output", out)])
        return hook

    def back(name):
        def hook(_m, grad_input, grad_output):
            fired.append(f"{name}.backward")
            saved.append((f"{name}.backward", "grad_output", grad_output[0]))
            if grad_input[0] is not None:
                saved.append((f"{name}.backward", "grad_input", grad_input[0]))
        return hook

    for name, mod in model.named_children():
        mod.register_forward_hook(fwd(name))
        if any(True for _ in mod.parameters()):
            mod.register_full_backward_hook(back(name))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x).pow(2).sum().backward()
    assert fired[-3:] == ["head.backward", "mid.backward", "zin.backward"]  # autograd: from the loss back
    # the dump gives them by name, every file at the same time: the order must come from the data
    hints = sorted((Hint(op, role, digest(t.detach()), tick=0) for op, role, t in saved), key=lambda h: h.op)
    got = settle(hints)
    assert sorted(got.rank, key=got.rank.__getitem__) == fired
    assert "backward ops after the forward pass" in got.note
