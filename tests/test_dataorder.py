"""Order recovered from the data: digests and the topological order they give."""

import numpy as np
import pytest
import torch

from precision_lab.readers.dataorder import digest, order_from_data


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
