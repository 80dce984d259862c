"""Diff two implementations: ops paired by their data (names, value anchors, data flow, fused N:1), the first pair
whose inputs agree within what the formats explain and whose output does not, from the library and the CLI."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.live import CaptureOptions
from precision_lab.live.recorder import Capture
from precision_lab.services.xdiff import diff_records
from precision_lab.services.xcalls import aligned
from precision_lab.services.xpair import pair_runs
from precision_lab.store import Store, close_all

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_dumps"
runner = CliRunner()


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def records(model, x, **opts):
    cap = Capture(model, write=False, options=CaptureOptions(keep_tensors=("*",), backward=False, params=False,
                                                             histogram=False, locations=False, **opts))
    with cap, torch.no_grad():
        cap.model(x)
    return cap.records


# ---- a small model and a rewrite of it with other names and a fused projection ----------------------------

class Ref(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.cat([F.gelu(self.a(x)), torch.tanh(self.b(x))], dim=-1)
        return x + self.head(self.norm(h))


class Rewrite(nn.Module):
    def __init__(self, bug=None):
        super().__init__()
        self.ab = nn.Linear(16, 16)  # a and b fused
        self.ln = nn.LayerNorm(16, eps=1e-2 if bug == "eps" else 1e-5)
        self.proj = nn.Linear(16, 16)
        self.bug = bug

    def forward(self, x):
        u, v = self.ab(x).split(8, dim=-1)
        h = torch.cat([F.gelu(u), torch.tanh(v)], dim=-1)
        y = self.proj(self.ln(h))
        return y if self.bug == "residual" else x + y


def _pair_models(bug=None):
    torch.manual_seed(0)
    ref = Ref().eval()
    new = Rewrite(bug).eval()
    with torch.no_grad():
        new.ab.weight.copy_(torch.cat([ref.a.weight, ref.b.weight]))
        new.ab.bias.copy_(torch.cat([ref.a.bias, ref.b.bias]))
        new.ln.load_state_dict(ref.norm.state_dict())
        new.proj.load_state_dict(ref.head.state_dict())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return ref, new, x


def test_a_rewrite_with_other_names_and_a_fused_projection_pairs_by_data_and_does_not_diverge():
    ref, new, x = _pair_models()
    res = diff_records(records(ref, x), records(new, x))
    p = res.pairing
    by_ref = {c.op: pair for pair in p.pairs for c in pair.ref}
    # the two projections against the one fused projection: N:1, their outputs concatenated
    fused = by_ref["a.linear.0"]
    assert fused.how == "fused N:1" and fused.concat and "b.linear.0" in fused.ref_ops
    assert "ab.linear.0" in fused.cand_ops
    assert by_ref["norm.layer_norm.0"].cand_ops[0] == "ln.layer_norm.0"
    assert by_ref["head.linear.0"].cand_ops[0] == "proj.linear.0"
    assert by_ref["gelu.0"].cand_ops == ("gelu.0",)
    assert not p.unpaired_ref and not p.unpaired_cand
    assert res.first is None
    assert all(0 < pair.confidence <= 1 for pair in p.pairs)


@pytest.mark.parametrize("bug, where", [("eps", "norm.layer_norm.0"), ("residual", "add.0")])
def test_an_injected_bug_is_named_at_the_pair_where_it_is(bug, where):
    ref, new, x = _pair_models(bug)
    res = diff_records(records(ref, x), records(new, x))
    assert res.first is not None
    assert res.first.pair.ref_ops[0] == where or where in res.first.pair.ref_ops
    assert res.first.inputs_agree and res.first.out_error > res.first.expected
    # nothing before it diverges, and what is before it agrees with the reference
    before = res.judgments[:res.judgments.index(res.first)]
    assert before and not any(j.diverges for j in before)


def test_a_reference_that_holds_the_fused_projection_pairs_it_with_the_separate_ones():
    ref, new, x = _pair_models()
    # the roles the other way round: the reference computes a and b in one projection
    res = diff_records(records(new, x), records(ref, x))
    p = res.pairing
    fused = next(pair for pair in p.pairs if "ab.linear.0" in pair.ref_ops)
    assert fused.how == "fused N:1" and fused.concat
    assert {"a.linear.0", "b.linear.0"} <= set(fused.cand_ops)
    assert fused.value_error is not None and fused.value_error < 1e-6
    assert not p.unpaired_ref and not p.unpaired_cand
    assert res.first is None


def test_a_benign_run_widens_each_ops_band_to_what_it_shows():
    ref, new, x = _pair_models("eps")
    a, b = records(ref, x), records(new, x)
    plain = diff_records(a, b)
    # a "benign" run that shows the very same difference: every op's band is at least 8x that difference
    calibrated = diff_records(a, b, benign=b)
    assert plain.first is not None and calibrated.first is None
    j = next(j for j in calibrated.judgments if "norm.layer_norm.0" in j.pair.ref_ops)
    assert j.expected == pytest.approx(8.0 * j.out_error)


def test_metrics_of_a_pair_match_float64_numpy():
    ref, new, x = _pair_models("eps")
    res = diff_records(records(ref, x), records(new, x))
    j = res.first
    with torch.no_grad():
        r = ref.norm(torch.cat([F.gelu(ref.a(x)), torch.tanh(ref.b(x))], -1)).double().numpy()
        u, v = new.ab(x).split(8, dim=-1)
        c = new.ln(torch.cat([F.gelu(u), torch.tanh(v)], -1)).double().numpy()
    d = c - r
    assert j.out_error == pytest.approx(np.sqrt((d ** 2).sum() / (r ** 2).sum()), rel=1e-9)
    cmp = j.comparison
    assert cmp.sqnr_db == pytest.approx(10 * np.log10((r ** 2).sum() / (d ** 2).sum()), rel=1e-9)
    assert cmp.max_abs_err == pytest.approx(np.abs(d).max(), rel=1e-12)
    assert cmp.cosine == pytest.approx((r * c).sum() / np.sqrt((r ** 2).sum() * (c ** 2).sum()), rel=1e-12)
    # the band: fp32's unit roundoff, times the measured conditioning and the accumulation over 16 values
    assert j.unit_roundoff == 2.0 ** -24
    assert j.expected == pytest.approx(4.0 * (j.kappa * (j.in_error or 0.0) + (2 + math.sqrt(j.accumulation))
                                              * 2.0 ** -24 + 2.0 ** -24))


def test_a_transposed_layout_is_aligned_before_it_is_compared():
    r = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    c = np.ascontiguousarray(np.transpose(r, (0, 2, 1)))
    assert np.array_equal(aligned(r, c), r)
    assert aligned(r, np.zeros(5)) is None


def test_values_that_cannot_be_paired_are_listed_not_forced():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    b = nn.Sequential(nn.Linear(8, 5), nn.Tanh()).eval()  # another computation, other sizes
    x = torch.randn(3, 8)
    p = pair_runs(records(a, x), records(b, x))
    assert not p.pairs
    assert p.unpaired_ref and p.unpaired_cand


# ---- the command line -----------------------------------------------------------------------------------

def test_cli_diff_of_two_dumps_names_the_first_divergent_pair_and_fails_on_it():
    dump = SAMPLES / "fp16-layernorm"
    r = runner.invoke(app, ["diff", f"{dump}:reference", f"{dump}:candidate", "--fail-on", "diverged"])
    assert r.exit_code == 1, r.output
    # x * x overflows fp16 while its input agrees within fp16's rounding
    assert "first divergent pair: ln.mul.0 -> ln.mul.0" in r.output
    r = runner.invoke(app, ["diff", f"{dump}:reference", f"{dump}:reference", "--fail-on", "diverged"])
    assert r.exit_code == 0, r.output
    assert "no pair diverges" in r.output


def test_cli_diff_writes_a_self_contained_html_page(tmp_path):
    dump = SAMPLES / "fp16-layernorm"
    page = tmp_path / "diff.html"
    r = runner.invoke(app, ["diff", f"{dump}:reference", f"{dump}:candidate", "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "First divergent pair: ln.mul.0 -&gt; ln.mul.0" in text
    assert "<script src" not in text and "http" not in text.split("</head>")[1]
    assert text.count('<tr class="error">') >= 1


def test_cli_diff_refuses_unusable_input_in_one_sentence(tmp_path):
    dump = SAMPLES / "fp16-layernorm"
    r = runner.invoke(app, ["diff", str(tmp_path / "nope"), str(dump)])
    assert r.exit_code == 2
    assert "no such dump folder or file" in r.output
    r = runner.invoke(app, ["diff", str(dump), str(dump)])
    assert r.exit_code == 2 and "name one as" in r.output
    r = runner.invoke(app, ["diff", f"{dump}:reference", f"{dump}:candidate", "--fail-on", "everything"])
    assert r.exit_code == 2 and "--fail-on" in r.output


def test_cli_diff_of_two_captured_sessions(tmp_path):
    ref, new, x = _pair_models("residual")
    db = tmp_path / "x.duckdb"
    for name, m in (("ref", ref), ("rewrite", new)):
        store = Store(db)
        with Capture(m, run=name, store=store, options=CaptureOptions(keep_tensors=("*",), backward=False)) as cap:
            with torch.no_grad():
                cap.model(x)
        close_all()
    r = runner.invoke(app, ["diff", "--db", str(db), "ref", "rewrite", "--fail-on", "diverged", "--json"])
    close_all()
    assert r.exit_code == 1, r.output
    import json

    doc = json.loads(r.output)
    assert "add.0" in doc["first_divergent_ops"]["reference"]  # the residual add the rewrite dropped
    assert {row["how"] for row in doc["pairs"]} >= {"fused N:1"}


# ---- real models: transformers against a rewrite, eager against compiled --------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("bug, module", [(None, None), ("eps", "layers.0.input_layernorm"),
                                         ("mask", "layers.0.self_attn"), ("residual", "layers.0"),
                                         ("rope_offset", "layers.0.self_attn")])
def test_transformers_llama_against_a_rewrite_with_other_names_and_fused_qkv(bug, module):
    m = _load(ROOT / "bench" / "cross_impl_models.py", "cross_impl_models_for_tests")
    cfg = m.llama_config(2)
    hf = m.hf_llama(cfg)
    mine = m.load_from_hf(m.MyLlama(cfg, bug=bug), hf)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    res = diff_records(records(hf, x), records(mine, x))
    p = res.pairing
    assert len(p.pairs) >= 60
    qkv = [q for q in p.pairs if "layers.0.self_attn.q_proj.linear.0" in q.ref_ops]
    assert qkv and qkv[0].how == "fused N:1" and "blocks.0.mix.qkv.linear.0" in qkv[0].cand_ops
    if bug is None:
        assert res.first is None
        assert p.count("anchor") > 30  # the values, not the names, paired them
        return
    assert res.first is not None
    named = res.first.pair.ref_ops
    assert any(op == module + ".forward.0" or op.startswith(module + ".") and op.count(".") == module.count(".") + 2
               for op in named), named


@pytest.mark.slow
def test_eager_against_compiled_from_the_cli_and_the_dashboard(tmp_path, monkeypatch):
    import copy

    import torch._dynamo

    blocks = _load(ROOT / "tests" / "models" / "compile_blocks.py", "compile_blocks_for_xdiff")
    eager = blocks.build().eval()
    compiled = copy.deepcopy(eager)
    for b in compiled.blocks:
        b.compile()
    x = blocks.inputs()
    db = tmp_path / "c.duckdb"
    torch._dynamo.reset()
    try:
        for name, model in (("eager", eager), ("compiled", compiled)):
            with Capture(model, run=name, store=Store(db), session=None if name == "eager" else "eager",
                         options=CaptureOptions(keep_tensors=("*",), backward=False)) as cap:
                with torch.no_grad():
                    cap.model(x)
            close_all()
    finally:
        torch._dynamo.reset()
    r = runner.invoke(app, ["diff", "--db", str(db), "eager:eager", "eager:compiled", "--fail-on", "diverged"])
    close_all()
    assert r.exit_code == 0, r.output
    assert "no pair diverges" in r.output
    assert "unpaired: 0 reference, 0 candidate" in r.output
    from ui_fixtures import frame_with, open_page, serve_db

    with serve_db(db, monkeypatch):  # and on the Diff page
        at = open_page("diff", session="eager", view="data")
        assert at.success and at.success[0].value.startswith("No pair diverges")
        assert len(frame_with(at, "how")) > 5


def llama_and_rewrite_db(db: Path) -> Path:
    """A database whose session ``hf`` holds a transformers Llama (run ``hf``) and a rewrite of it with other
    module names, a fused qkv and LayerNorm's eps wrong (run ``rewrite``), every tensor kept."""
    m = _load(ROOT / "bench" / "cross_impl_models.py", "cross_impl_models_for_app")
    cfg = m.llama_config(2)
    hf = m.hf_llama(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for run, model, session in (("hf", hf, None), ("rewrite", m.load_from_hf(m.MyLlama(cfg, bug="eps"), hf),
                                                    "hf")):
        with Capture(model, run=run, store=Store(db), session=session,
                     options=CaptureOptions(keep_tensors=("*",), backward=False)) as cap:
            with torch.no_grad():
                cap.model(x)
        close_all()
    return db


@pytest.mark.slow
def test_transformers_llama_against_its_rewrite_in_the_dashboard(tmp_path, monkeypatch):
    from ui_fixtures import frame_with, open_page, serve_db

    db = llama_and_rewrite_db(tmp_path / "app.duckdb")
    with serve_db(db, monkeypatch):
        at = open_page("diff", session="hf", view="data")
        table = frame_with(at, "how")
        assert "fused N:1" in set(table["how"])  # q, k and v projections against the fused qkv
        assert at.error and "layers.0.input_layernorm.add.0 -> blocks.0.norm1.add.0" in at.error[0].value.replace(
            "\\", "")


@pytest.mark.slow
@pytest.mark.parametrize("bug, variant, module", [
    ("softmax_dim", None, "h.1.attn"), ("transposed_weight", None, "h.1.attn"), (None, "autocast", None)])
def test_transformers_gpt2_that_holds_the_fused_qkv_against_a_rewrite_with_separate_projections(bug, variant, module):
    h = _load(ROOT / "bench" / "cross_impl_heldout.py", "cross_impl_heldout_for_tests")
    hf = h.hf_gpt2()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    res = diff_records(records(hf, x), records(h.gpt2_rewrite(hf, bug, variant), x))
    qkv = [q for q in res.pairing.pairs if "h.0.attn.c_attn.addmm.0" in q.ref_ops]
    assert qkv and qkv[0].how == "fused N:1" and "blocks.0.att.qkv.v.linear.0" in qkv[0].cand_ops
    if module is None:  # a block computed in bf16 under autocast, judged at its fp32 boundary: no alarm
        assert res.first is None, res.first.pair.label
        return
    assert res.first is not None
    assert any(op.startswith(module + ".") for op in res.first.pair.ref_ops), res.first.pair.label
