"""Which format a candidate run's error is judged against: the narrowest its policy passes values through."""

import numpy as np
import pytest
import torch

from precision_lab.fixes.policy import get_policy
from precision_lab.formats import FORMATS
from precision_lab.services.capture import judged_run_dtype
from precision_lab.metrics import compare


def test_fp8_fake_quant_policy_is_judged_against_its_fp8_format():
    policy = get_policy("fp8-e5m2-tensor")  # fp16 compute, e5m2 fake quantisation
    assert judged_run_dtype(policy, "float16") == "float8_e5m2"
    # without quantisation the run's own dtype decides, and a coarser real dtype wins over the declared one
    assert judged_run_dtype(get_policy("fp16"), "float16") == "float16"
    assert judged_run_dtype(get_policy("fp16"), "bfloat16") == "bfloat16"
    assert judged_run_dtype(None, "float16") == "float16"


def test_e5m2_quantisation_noise_is_expected_for_e5m2_but_not_for_fp16():
    # a real e5m2 round trip of the values: exactly the noise an e5m2 run is entitled to
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=g)
    cand = ref.to(torch.float8_e5m2).to(torch.float16)
    assert compare(ref, cand, cand_format="fp8_e5m2").verdict == "expected"
    assert compare(ref, cand, cand_format="fp16").verdict == "error"
    assert FORMATS["fp8_e5m2"].eps > FORMATS["fp16"].eps


@pytest.mark.slow
def test_rerun_of_an_fp8_recipe_judges_its_output_against_fp8(store):
    from precision_lab.fixes.recipes import get_recipe
    from precision_lab.services.rerun import capture_recipe, rerun_session

    session = capture_recipe(store, get_recipe("fp8-zero-scale"), local_error=False)
    run_id = rerun_session(store, session, ["scale-fp32"])
    df = store.df("SELECT cand_format, verdict FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated' "
                  "AND verdict IS NOT NULL", [run_id])
    assert len(df) > 0
    assert set(df["cand_format"]) == {"fp8_e5m2"}
    assert "nonfinite" not in set(df["verdict"]) and "error" not in set(df["verdict"])
