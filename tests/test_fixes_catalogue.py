"""The fix catalogue: parsing, applying, and the one-line reasons."""

import math

import pytest

from precision_lab.fixes.catalogue import FIXES, FixError, apply_fixes, fix_label, parse_fix, split_specs
from precision_lab.fixes.policy import PrecisionPolicy, QuantConfig

FP16 = PrecisionPolicy("fp16", "fp16")
FP8 = PrecisionPolicy("fp8", "fp16", quant=QuantConfig("fp8_e5m2", "tensor", "fp16", calibration="histogram"))

REQUIRED = ["keep-fp32", "use-bf16", "scale-fp32", "amax-floor", "eps", "stable-softmax", "stats-fp32",
            "sanitize-nonfinite", "calibrate-finite-only"]


def test_required_fixes_registered_with_reasons_and_parsable_examples():
    for name in REQUIRED:
        assert name in FIXES
    for name, d in FIXES.items():
        fx = parse_fix(d.example)
        assert fx.name == name
        assert len(fx.reason) > 20 and "\n" not in fx.reason


def test_reasons_quote_format_limits():
    import numpy as np

    fp16_max = float(np.finfo(np.float16).max)
    assert f"{fp16_max:,.0f}" in parse_fix("use-bf16").reason  # 65,504
    # ln(65504) = 11.09: where fp16 exp() overflows
    assert f"{math.log(fp16_max):.2f}" in parse_fix("stable-softmax").reason
    assert "1e-12" in parse_fix("amax-floor:1e-12").reason


def test_apply_edits_policy_and_records_specs():
    p = apply_fixes(FP8, ["scale-fp32", "amax-floor:1e-12", "keep-fp32:down_proj", "eps:1e-3"])
    assert p.quant.scale_format == "fp32" and p.quant.amax_floor == 1e-12
    assert p.overrides == (("down_proj", "fp32"),) and p.eps == 1e-3
    assert p.fixes == ("scale-fp32", "amax-floor:1e-12", "keep-fp32:down_proj", "eps:1e-3")
    assert FP8.quant.scale_format == "fp16"  # frozen: the original is untouched
    q = apply_fixes(FP16, "stable-softmax+stats-fp32+two-pass-variance+sanitize-nonfinite:norm")
    assert q.stable_softmax and q.stats_fp32 and q.two_pass_variance and q.sanitize == ("norm",)
    assert apply_fixes(FP8, "calibrate-finite-only").quant.finite_only
    b = apply_fixes(FP8, "use-bf16")
    assert b.dtype == "bf16" and b.quant.scale_format == "bf16"
    assert apply_fixes(FP8, "fp8-format:fp8_e4m3fn").quant.format == "fp8_e4m3fn"
    assert apply_fixes(FP8, "scaling:row").quant.granularity == "row"
    assert apply_fixes(PrecisionPolicy("f", "fp16", flush_to_zero=True), "keep-subnormals").flush_to_zero is False


def test_split_keeps_exponent_signs():
    assert split_specs("scale-fp32+amax-floor:1e+3") == ["scale-fp32", "amax-floor:1e+3"]
    assert split_specs(["a+b", "c"]) == ["a", "b", "c"]
    assert fix_label(["scale-fp32", " amax-floor:1e-12 "]) == "scale-fp32+amax-floor:1e-12"


@pytest.mark.parametrize("spec, msg", [
    ("no-such-fix", r"unknown fix 'no-such-fix'; known fixes: amax-floor, amax-percentile, calibrate-finite-only"),
    ("eps", r"fix 'eps' needs an argument: e.g. eps:1e-3"),
    ("use-bf16:yes", r"fix 'use-bf16' takes no argument \(got 'yes'\)"),
    ("amax-floor:tiny", r"fix 'amax-floor': 'tiny' is not a number"),
    ("eps:-1", r"fix 'eps': value -1 must be a finite number > 0"),
    ("eps:inf", r"fix 'eps': value inf must be a finite number > 0"),
    ("fp8-format:fp9", r"fix 'fp8-format': unknown format 'fp9'"),
    ("scaling:block", r"fix 'scaling': 'block' must be one of tensor, row"),
    ("keep-fp32:a b", r"module pattern 'a b' must be non-empty with no spaces"),
    ("", r"a fix spec must be a non-empty string"),
])
def test_parse_errors_name_the_problem(spec, msg):
    with pytest.raises(FixError, match=msg):
        parse_fix(spec)


@pytest.mark.parametrize("policy, spec, msg", [
    (FP16, "scale-fp32", r"fix 'scale-fp32' edits fp8 fake-quantisation settings, but policy 'fp16'"),
    (FP16, "amax-floor:1", r"fix 'amax-floor' edits fp8"),
    (PrecisionPolicy("f32"), "use-bf16", r"policy 'f32' \(fp32\) uses no fp16"),
    (FP16, "keep-subnormals", r"does not flush subnormals"),
    (PrecisionPolicy("s", "fp16", stable_softmax=True), "stable-softmax", r"already has it"),
    (apply_fixes(FP8, "scale-fp32"), "scale-fp32", r"already computes scales in fp32"),
    (PrecisionPolicy("d", "fp16", quant=QuantConfig()), "calibrate-finite-only", r"applies to histogram calibration"),
])
def test_fix_that_does_not_apply_says_why(policy, spec, msg):
    with pytest.raises(FixError, match=msg):
        apply_fixes(policy, spec)
