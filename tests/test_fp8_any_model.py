"""fp8 presets on a user's model: every torch.nn.Linear is fake-quantised (the quantisation steps recorded as
ops), the zero-scale NaN of an all-zero row reproduces on a Llama built from config, and an amax floor fixes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.policy import POLICIES, PolicyError
from precision_lab.live import PairOptions
from precision_lab.services.report import first_nonfinite
from precision_lab.store import queries as q

pytestmark = pytest.mark.slow  # builds transformers models

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")


def _llama(zero_row: bool):
    import transformers  # seconds to import: only the tests that build a Llama load it

    def build():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
        if zero_row:
            with torch.no_grad():
                m.model.embed_tokens.weight[0] = 0.0  # a padding token embeds to an all-zero row
        return m
    return build


IDS = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))
PADDED = IDS.clone()
PADDED[0, 3] = 0
NO_LOCAL = PairOptions(local_error=False)


def _candidate(store, name):
    return next(r for r in q.session_runs(store, store.session(name).session_id) if r.kind == "candidate")


def test_every_linear_of_a_llama_is_quantised_and_fp8_costs_accuracy(store):
    linears = sorted(n for n, m in _llama(False)().named_modules() if type(m) is nn.Linear)
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    sqnr = {}
    for preset in ("fp16", "fp8-e4m3-row"):
        name = capture_pair(_llama(False), {"input_ids": IDS}, POLICIES[preset], store=store, pair=NO_LOCAL,
                            name=preset)
        cand = _candidate(store, name)
        quantised = {r["op"].split(".act_quant.")[0] for r in
                     store.sql("SELECT DISTINCT op FROM tensors WHERE run_id = ? AND op LIKE '%.act_quant.amax.%'",
                               [cand.run_id]).df().to_dict("records")}
        assert quantised == (set(linears) if preset != "fp16" else set())
        assert first_nonfinite(store, cand.run_id) is None
        sqnr[preset] = q.last_accumulated_output(store, cand.run_id).sqnr_db
    # e4m3 keeps 3 mantissa bits against fp16's 10: the output is further from fp32
    assert sqnr["fp8-e4m3-row"] < sqnr["fp16"] - 20


def test_a_zero_row_gives_the_zero_scale_nan_and_an_amax_floor_fixes_it(store):
    name = capture_pair(_llama(True), {"input_ids": PADDED}, POLICIES["fp8-e4m3-row"], store=store,
                        pair=NO_LOCAL, name="padded")
    f = first_nonfinite(store, _candidate(store, name).run_id)
    assert f.op == "model.layers.0.self_attn.q_proj.act_quant.inv_scale.reciprocal.0"  # 1/0: the row's scale
    assert independent_zero_row_scale_is_zero()
    fixed = apply_fixes(POLICIES["fp8-e4m3-row"], ["amax-floor:1e-12"])
    name = capture_pair(_llama(True), {"input_ids": PADDED}, fixed, store=store, pair=NO_LOCAL, name="floored")
    assert first_nonfinite(store, _candidate(store, name).run_id) is None


def independent_zero_row_scale_is_zero() -> bool:
    """The RMSNorm of an all-zero row is zero, so that row's amax and scale are 0 and 1/scale is inf."""
    x = torch.zeros(1, 64)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    scale = y.abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max
    return bool(scale.item() == 0 and torch.isinf(1 / scale).all())


def test_a_model_without_linears_is_refused_not_mislabelled(store):
    def convs():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())

    with pytest.raises(PolicyError, match="has none"):
        capture_pair(convs, torch.randn(1, 3, 8, 8), POLICIES["fp8-e4m3-tensor"], store=store, pair=NO_LOCAL)
    assert len(store.sessions()) == 0
