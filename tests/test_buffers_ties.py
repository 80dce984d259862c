"""Buffers recorded like parameters, tied parameters moving together under an fp32 island, and an island that
changes nothing never offered (issue 24, item 5)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_lab
from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.policy import PrecisionPolicy, island_effect, tied_groups
from precision_lab.live import CaptureOptions
from precision_lab.live.recorder import Capture
from precision_lab.records import INPUT_ROLES, ROLES, split_tensor_name
from precision_lab.services.applicable import _fingerprint, _try, island_targets
from precision_lab.store import Store
from precision_lab.store import queries as q

FP16 = PrecisionPolicy("fp16", "fp16")


# ---- buffers ----------------------------------------------------------------------------------

class BNNet(nn.Module):
    def __init__(self, affine: bool = True):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def build_bn():
    torch.manual_seed(0)
    m = BNNet()
    with torch.no_grad():
        m.bn.running_mean.copy_(torch.tensor([0.5, 1e5, -0.25, 2.0]))
        m.bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.5, 3.0]))
    return m.eval()


def _rows(store, sql, params):
    cur = store.sql(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def test_buffer_role_is_vocabulary():
    assert "buffer" in ROLES and "buffer" in INPUT_ROLES
    assert split_tensor_name("bn.forward.0.buffer.running_mean") == ("bn.forward.0", "buffer", "running_mean")


@pytest.mark.slow
def test_capture_pair_records_buffers_with_the_reference_absmax(store):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    name = precision_lab.capture_pair(build_bn, x, torch.float16, store=store)
    runs = {r["kind"]: r for _, r in store.runs(store.session(name).session_id).iterrows()}
    ref_id, cand_id = runs["reference"]["run_id"], runs["candidate"]["run_id"]
    want = build_bn()
    for run_id, dtype in ((ref_id, "float32"), (cand_id, "float16")):
        bufs = {r["index"]: r for r in _rows(store, "SELECT * FROM tensors WHERE run_id = ? AND role = 'buffer'",
                                              [run_id])}
        # the floating buffers of the module, once, under its call; the integer counter is not one
        assert set(bufs) == {"running_mean", "running_var"}
        assert {r["op"] for r in bufs.values()} == {"bn.forward.0"}
        tdt = getattr(torch, dtype)
        for key, r in bufs.items():
            b = getattr(want.bn, key).to(tdt).double().numpy()  # what the run held after its cast, in float64
            fin = b[np.isfinite(b)]
            assert r["dtype"] == dtype and r["numel"] == 4
            assert r["inf_count"] == int(np.isinf(b).sum())
            assert r["absmax"] == pytest.approx(np.abs(fin).max(), rel=1e-12)
            assert r["l2norm"] == pytest.approx(np.linalg.norm(fin), rel=1e-9)
            assert r["min"] == pytest.approx(fin.min(), rel=1e-12) and r["max"] == pytest.approx(fin.max(), rel=1e-12)
    # fp16 cannot hold 1e5: the candidate's running_mean holds inf, the reference's the value itself
    ref_mean = _rows(store, "SELECT * FROM tensors WHERE run_id = ? AND role = 'buffer' AND \"index\" = "
                            "'running_mean'", [ref_id])[0]
    assert ref_mean["absmax"] == 1e5 and not ref_mean["nonfinite"]
    bad = [r for r in q.nonfinite_records(store, cand_id) if r.role == "buffer"]
    assert len(bad) == 1 and bad[0].index == "running_mean" and bad[0].stats.inf_count == 1
    assert bad[0].ref_absmax == 1e5 and bad[0].introduced == 1 and not bad[0].ref_nonfinite
    # each buffer compared with the reference's, by name, element-wise
    cmp = _rows(store, """SELECT c.* FROM comparisons c WHERE c.kind = 'accumulated' AND c.cand_run_id = ?
                          AND c.role = 'buffer'""", [cand_id])
    assert sorted(r["index"] for r in cmp) == ["running_mean", "running_var"]
    assert {r["match"] for r in cmp} == {"exact"}


@pytest.mark.slow
def test_buffer_recorded_as_read_before_the_module_updates_it():
    """In training, BatchNorm updates its running statistics in place during its call: the record (statistics and
    kept tensor) is the buffer the call read, and buffers get no gradient records."""
    torch.manual_seed(0)
    m = BNNet().train()
    with torch.no_grad():
        m.bn.running_mean.copy_(torch.tensor([3.0, -7.0, 0.125, 1.5]))
    before = m.bn.running_mean.detach().clone()
    x = torch.randn(5, 4)
    cap = Capture(m, run="bn", store=Store(":memory:"), options=CaptureOptions(keep_tensors=("bn.*",)))
    with cap:
        y = cap.model(x)
        y.sum().backward()
    assert not torch.equal(m.bn.running_mean, before)  # the call did update it
    rec = next(r for r in cap.records if r.role == "buffer" and r.index == "running_mean")
    assert rec.op == "bn.forward.0" and rec.direction == "forward"
    assert torch.equal(rec.tensor, before)
    b = before.double().numpy()
    assert rec.stats.absmax == pytest.approx(np.abs(b).max()) and rec.stats.mean == pytest.approx(b.mean())
    assert rec.stats.l2norm == pytest.approx(np.linalg.norm(b))
    # gradients: the parameters' own, none for (or through) a buffer
    grads = [r for r in cap.records if r.direction == "backward" and r.op.startswith("bn.")]
    assert {r.index for r in grads if r.role == "param_grad"} == {"weight", "bias"}
    assert not any("running" in str(r.index) for r in grads)
    # without parameter records there are no buffer records either
    cap2 = Capture(BNNet().eval(), run="np", store=Store(":memory:"), options=CaptureOptions(params=False))
    with cap2:
        cap2.model(x)
    assert not any(r.role in ("param", "buffer") for r in cap2.records)


# ---- tied parameters -------------------------------------------------------------------------

def _gpt2(tied: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                  tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _lm_head_io(model, ids):
    seen = {}
    hs = [model.transformer.wte.register_forward_hook(lambda m, a, o: seen.__setitem__("wte", o)),
          model.lm_head.register_forward_hook(lambda m, a, o: seen.__setitem__("head", (a[0], o)))]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in hs:
        h.remove()
    return seen["wte"], seen["head"][0], seen["head"][1], logits


@pytest.mark.slow
def test_tied_embedding_is_detected():
    m = _gpt2()
    assert m.lm_head.weight is m.transformer.wte.weight
    assert tied_groups(m) == {"transformer.wte": ["lm_head"], "lm_head": ["transformer.wte"]}
    assert tied_groups(_gpt2(tied=False)) == {}


def test_tie_through_shared_storage_is_detected():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = nn.Parameter(a.weight.data)  # another Parameter over the same memory
    m = nn.Sequential(a, nn.ReLU(), b)
    assert tied_groups(m) == {"0": ["2"], "2": ["0"]}
    eff = island_effect(m, "0", FP16)
    assert [p for p, _, _ in eff.partners] == ["2"]


@pytest.mark.slow
@pytest.mark.parametrize("island,partner", [("lm_head", "transformer.wte"), ("wte", "lm_head")])
def test_island_on_a_tied_module_moves_its_partner_and_computes_in_fp32(island, partner):
    m = _gpt2()
    w32 = m.transformer.wte.weight.detach().clone()
    eff = island_effect(m, island, FP16)
    assert eff.changes and [p for p, _, _ in eff.partners] == [partner]
    assert partner in eff.note and "fp32" in eff.note
    pol = apply_fixes(FP16, f"keep-fp32:{island}")
    assert any(partner in n for n in pol.island_notes(m))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    fixed = pol.prepare(copy.deepcopy(m))
    # one tensor, kept in fp32 for both modules (neither cast to fp16 nor cast back by the later module)
    assert fixed.lm_head.weight is fixed.transformer.wte.weight
    assert fixed.lm_head.weight.dtype == torch.float32 and torch.equal(fixed.lm_head.weight, w32)
    emb, head_in, head_out, logits = _lm_head_io(fixed, ids)
    # the embedding and the head computed in fp32 from the original weights, as a hand-built fp32 computation
    assert emb.dtype == torch.float32 and torch.equal(emb, F.embedding(ids, w32))
    assert head_in.dtype == torch.float32 and head_out.dtype == torch.float32
    assert torch.equal(head_out, head_in @ w32.T)
    # the rest of the model stayed fp16
    assert fixed.transformer.h[0].mlp.c_fc.weight.dtype == torch.float16
    # the plain fp16 policy: both fp16
    plain = FP16.prepare(copy.deepcopy(m))
    emb16, _, out16, _ = _lm_head_io(plain, ids)
    assert emb16.dtype == torch.float16 and out16.dtype == torch.float16


# ---- an island that changes nothing ------------------------------------------------------------

class Counter(nn.Module):
    """No parameter, no buffer: counts its calls and passes its input on."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * 1.5


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pool = nn.AvgPool1d(2)
        self.count = Counter()
        self.norm = nn.BatchNorm1d(3, affine=False)  # buffers only
        self.block = nn.Sequential(nn.GELU(), nn.Linear(3, 3))  # a container whose child holds parameters
        self.act = nn.Tanh()

    def forward(self, x):
        h = self.pool(self.fc(x).unsqueeze(1)).squeeze(1) * 300.0
        return self.act(self.block(self.norm(self.count(h))))


def _state_and_output(model, policy, x):
    m = policy.prepare(copy.deepcopy(model))
    with torch.no_grad():
        y = m(policy.prepare_inputs(x))
    return [(n, t.dtype) for n, t in list(m.named_parameters()) + list(m.named_buffers())], y


def test_island_changes_nothing_exactly_when_the_model_computes_the_same():
    torch.manual_seed(0)
    model = Mixed().eval()
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    state0, y0 = _state_and_output(model, FP16, x)
    targets = island_targets(model, FP16)
    for path, _ in model.named_modules():
        if not path:
            continue
        state, y = _state_and_output(model, apply_fixes(FP16, f"keep-fp32:{path}"), x)
        differs = state != state0 or y.dtype != y0.dtype or not torch.equal(y.float(), y0.float())
        eff = island_effect(model, path, FP16)
        assert eff.changes == differs, (path, eff)
        assert (path in targets) == differs
        got = _try(model, FP16, _fingerprint(FP16.prepare(copy.deepcopy(model))), f"keep-fp32:{path}")
        assert got.applies == differs, got
        if not differs:
            assert "changes nothing" in got.reason
    assert set(targets) == {"fc", "norm", "block", "block.1"}
    # no parameter, no buffer: nothing an island could cast; its inputs are not cast
    assert not island_effect(model, "pool", FP16).changes and not island_effect(model, "count", FP16).changes
    # a buffer-only module: its buffers and inputs move to fp32 (before, its buffers did and its inputs did not)
    assert island_effect(model, "norm", FP16).tensors == ("norm.running_mean", "norm.running_var")
    # an island already in the policy changes nothing the second time
    assert not island_effect(model, "fc", apply_fixes(FP16, "keep-fp32:fc")).changes


def test_buffer_only_island_casts_its_inputs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)).eval()
    with torch.no_grad():
        m[1].running_mean.copy_(torch.tensor([0.0, 1e5, 0.0, 0.0]))
    x = torch.randn(3, 4)
    pol = apply_fixes(FP16, "keep-fp32:1")
    fixed = pol.prepare(copy.deepcopy(m))
    with torch.no_grad():
        h = fixed[0](pol.prepare_inputs(x))
        y = fixed(pol.prepare_inputs(x))
    assert h.dtype == torch.float16 and y.dtype == torch.float32
    rm, rv = m[1].running_mean, m[1].running_var
    want = (h.float() - rm) / torch.sqrt(rv + m[1].eps)  # fp32 by hand from the fp16 input
    assert torch.allclose(y, want, rtol=1e-6, atol=0) and torch.isfinite(y).all()
