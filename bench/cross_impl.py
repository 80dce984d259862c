"""Cross-implementation diff: pairing by data and the first divergent pair, graded against ground truth.

    python bench/cross_impl.py            (about two minutes on 2 CPU cores)

Five model families (a ``transformers`` Llama decoder built from config, a ``transformers`` BERT encoder, a conv
net, a mixture-of-experts block, a model of our own), each run as a reference and as another implementation:
eager vs ``torch.compile`` (whole model, per block, and a compiled run recorded only at its regions' boundaries),
the Llama against a rewrite with other module names, a fused qkv projection and its own RoPE and attention code,
BERT with SDPA against its eager attention, a conv net against one with BatchNorm folded into the convs, fp32
against fake fp8 with quantise ops, and two versions of one block.  Silent bugs (a wrong eps, a RoPE offset, a
wrong or missing mask, a missing or transposed scale, a dropped residual, a wrong activation, a transposed or
flipped weight, a routing bug) are each switched on in one module; benign variants change only what rounding
explains (reduction order, attention kernel, compile, folding, layout, fp8 done right).

Ground truth: every reference call's partner in the other implementation, from a module-path mapping (the names
of the same op where both exist; inside a fused region, the calls of the same module that have no namesake).
It prints, over all cases: pairing precision (calls placed in a pair with a right partner / calls placed in
pairs) and recall (reference calls with a known partner paired with it / reference calls with a known partner);
for bugs, the first divergent pair right (it lies in the module the bug is in); for benign variants, false alarms
(any divergent pair); and the time to capture and diff a 32-layer Llama against its rewrite, one step.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import cross_impl_models as M  # noqa: E402
from precision_lab.live import CaptureOptions  # noqa: E402
from precision_lab.live.recorder import Capture  # noqa: E402
from precision_lab.services.xdiff import diff_records  # noqa: E402
from precision_lab.records import to_numpy  # noqa: E402
from precision_lab.services.xcalls import op_calls  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def capture(model, x, keep_only: Optional[Callable[[str], bool]] = None):
    cap = Capture(model, write=False, options=CaptureOptions(keep_tensors=("*",), backward=False, params=False,
                                                             histogram=False, locations=False))
    with cap, torch.no_grad():
        cap.model(x)
    recs = cap.records
    if keep_only is not None:
        recs = [r for r in recs if keep_only(r.op)]
    return recs


def _module(op: str) -> str:
    return ".".join(op.split(".")[:-2])


@dataclass
class Case:
    family: str
    pair: str
    name: str
    kind: str  # bug | benign
    ref: list
    cand: list
    translate: Callable[[str], str] = lambda op: op
    region: Optional[Callable[[str], Optional[str]]] = None  # ref op -> the candidate region call holding it
    bug_module: Optional[str] = None
    cand_format: Optional[str] = None
    result: object = field(default=None, repr=False)


def _value_groups(records) -> dict[str, frozenset]:
    """Each call's op -> the ops of its run whose first float output holds the very same values (a module call
    and the op inside it, a cast to the dtype a tensor already has): one datum, whichever call names it."""
    by_value: dict[tuple, set] = {}
    key_of = {}
    for call in op_calls(records)[0]:
        t = call.out.tensor
        k = (tuple(t.shape), hash(to_numpy(t).tobytes())) if t is not None else (call.op,)
        by_value.setdefault(k, set()).add(call.op)
        key_of[call.op] = k
    return {op: frozenset(by_value[k]) for op, k in key_of.items()}


def grade_pairing(c: Case) -> tuple[int, int, int, int]:
    """(calls in pairs with a right partner, calls in pairs, reference calls found, reference calls with a known
    partner)."""
    ref_same, cand_same = _value_groups(c.ref), _value_groups(c.cand)
    cand_calls = set(cand_same)
    translated = {c.translate(r) for r in ref_same}

    def known(r: str) -> set:
        out = set()
        for r2 in ref_same[r]:
            t = c.translate(r2)
            if t in cand_calls:
                out |= cand_same[t]
            elif c.region is not None and c.region(r2) in cand_calls:
                out |= cand_same[c.region(r2)]
        return out

    def truth(r: str) -> set:
        # and the candidate's own calls in the same module, or below it, that have no namesake (a fused region's
        # ops, quantise ops)
        m = _module(c.translate(r))
        return known(r) | {x for x in cand_calls if x not in translated
                           and (_module(x) == m or _module(x).startswith(m + "."))}

    good = placed = 0
    for p in c.result.pairing.pairs:
        cands = set(p.cand_ops)
        truths = [truth(r) for r in p.ref_ops]
        for t in truths:
            placed += 1
            good += bool(t & cands)
        for x in p.cand_ops:
            placed += 1
            good += any(x in t for t in truths)
    found = total = 0
    partner = {r: set(p.cand_ops) for p in c.result.pairing.pairs for r in p.ref_ops}
    for r in ref_same:
        want = known(r)
        if want:
            total += 1
            found += bool(want & partner.get(r, set()))
    return good, placed, found, total


def first_right(c: Case) -> bool:
    f = c.result.first
    if f is None:
        return False
    return any(_module(op) == c.bug_module or op == c.bug_module + ".forward.0" or
               (_module(op).startswith(c.bug_module + ".") and op.split(".")[-2] != "forward")
               for op in f.pair.ref_ops)


# ---- the cases ------------------------------------------------------------------------------------------

def llama_cases(compile_ok: bool) -> list[Case]:
    cfg = M.llama_config(2)
    hf = M.hf_llama(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = capture(hf, x)
    out = []
    where = {"eps": "layers.1.input_layernorm", "rope_offset": "layers.1.self_attn", "mask": "layers.1.self_attn",
             "scale": "layers.1.self_attn", "transposed_scale": "layers.1.self_attn", "residual": "layers.1",
             "silu_gelu": "layers.1.mlp"}
    for bug in M.LLAMA_BUGS:
        mine = M.load_from_hf(M.MyLlama(cfg, bug=bug, bug_layer=1), hf)
        out.append(Case("decoder", "hf vs rewrite", bug, "bug", ref, capture(mine, x), M.llama_module,
                        bug_module=where[bug]))
    for v in M.LLAMA_BENIGN:
        mine = M.load_from_hf(M.MyLlama(cfg, variant=v), hf)
        out.append(Case("decoder", "hf vs rewrite", v, "benign", ref, capture(mine, x), M.llama_module))
    mine = M.load_from_hf(M.MyLlama(cfg), hf)
    base = capture(mine, x)
    out.append(Case("decoder", "fp32 vs bf16", "rewrite in bf16", "benign", ref,
                    capture(copy.deepcopy(mine).to(torch.bfloat16), x), M.llama_module))
    if compile_ok:
        whole = copy.deepcopy(mine)
        whole.compile()
        out.append(Case("decoder", "eager vs compiled", "whole model", "benign", base, capture(whole, x)))
        comp = copy.deepcopy(mine)
        for b in comp.blocks:
            b.compile()
        out.append(Case("decoder", "eager vs compiled", "per block", "benign", base, capture(comp, x)))
        region = lambda op: ".".join(op.split(".")[:2]) + ".forward.0" if op.startswith("blocks.") else None  # noqa
        out.append(Case("decoder", "eager vs compiled", "region boundaries only", "benign", base,
                        capture(comp, x, keep_only=lambda op: not op.startswith("blocks.") or
                                op.count(".") == 3 and op.endswith(".forward.0")), region=region))
        torch._dynamo.reset()
    return out


def bert_cases() -> list[Case]:
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = capture(M.bert("sdpa"), x)
    out = [Case("encoder", "sdpa vs eager attention", "attention kernel", "benign", ref,
                capture(M.bert("eager"), x))]
    for bug in M.BERT_BUGS:
        m = M.bert("sdpa")
        where = M.bert_bug(m, bug)
        out.append(Case("encoder", "two versions", bug, "bug", ref, capture(m, x), bug_module=where))
    out.append(Case("encoder", "fp32 vs bf16", "bf16", "benign", ref, capture(M.bert("sdpa").to(torch.bfloat16), x)))
    m = M.bert("eager")
    where = M.bert_bug(m, "scale")
    out.append(Case("encoder", "sdpa vs eager attention", "scale (eager)", "bug", ref, capture(m, x),
                    bug_module=where))
    return out


def conv_cases(compile_ok: bool) -> list[Case]:
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    base = M.conv_net()
    ref = capture(base, x)
    where = {"eps": "blocks.1.bn", "scale": "blocks.1", "relu": "blocks.1", "residual": "blocks.1",
             "flipped": "blocks.1.conv"}
    out = [Case("conv", "two versions", b, "bug", ref, capture(M.conv_net(bug=b), x), bug_module=where[b])
           for b in M.CONV_BUGS]
    region = lambda op: op.replace(".conv.", ".bn.", 1) if ".conv." in op else None  # noqa: E731
    out.append(Case("conv", "BatchNorm folded", "folded conv", "benign", ref, capture(M.conv_net(fold=True), x),
                    region=region))
    out.append(Case("conv", "fp32 vs bf16", "bf16", "benign", ref,
                    capture(copy.deepcopy(base).to(torch.bfloat16), x.to(torch.bfloat16))))
    cl = copy.deepcopy(base).to(memory_format=torch.channels_last)
    out.append(Case("conv", "two versions", "channels_last", "benign", ref,
                    capture(cl, x.to(memory_format=torch.channels_last))))
    if compile_ok:
        comp = copy.deepcopy(base)
        comp.compile()
        out.append(Case("conv", "eager vs compiled", "whole model", "benign", ref, capture(comp, x)))
        torch._dynamo.reset()
    return out


def moe_cases() -> list[Case]:
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))

    def build(**kw):
        torch.manual_seed(0)
        return M.MoeNet(**kw).eval()

    ref = capture(build(), x)
    out = [Case("moe", "two versions", b, "bug", ref, capture(build(bug=b), x), bug_module="moe")
           for b in M.MOE_BUGS]
    out.append(Case("moe", "two versions", "experts batched", "benign", ref, capture(build(batched=True), x)))
    out.append(Case("moe", "two versions", "experts summed in reverse", "benign", ref,
                    capture(build(reverse=True), x)))
    d = build()
    d.double()
    out.append(Case("moe", "fp32 vs fp64", "fp64 reference", "benign", ref, capture(d.float(), x)))
    return out


def own_cases() -> list[Case]:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    ref = capture(M.own_fp8(quantise=False), x)
    out = []
    for b in M.OWN_BUGS:
        out.append(Case("own", "fp32 vs fp8", b, "bug", ref, capture(M.own_fp8(bug=b), x),
                        bug_module="layers.1.fc" if b != "residual" else "layers.1", cand_format="fp8_e4m3fn"))
    out.append(Case("own", "fp32 vs fp16", "fp16", "benign", ref,
                    capture(M.own_fp8(quantise=False).half(), x.half())))
    for per_row in (False, True):
        out.append(Case("own", "fp32 vs fp8", "fp8 per row" if per_row else "fp8 per tensor", "benign", ref,
                        capture(M.own_fp8(per_row=per_row), x), cand_format="fp8_e4m3fn"))
    return out


def run_cases(cases: list[Case]) -> None:
    for c in cases:
        c.result = diff_records(c.ref, c.cand, cand_format=c.cand_format)


def report(cases: list[Case]) -> dict:
    """Print the per-case table of ``cases`` (each already run) and return the totals the summary lines use."""
    print(f"{'family':8} {'pair':24} {'case':26} {'kind':6} {'pairs':>5} {'prec':>6} {'recall':>6} "
          f"{'unpaired':>9}  first divergent pair")
    tot = [0, 0, 0, 0]
    bugs = right = benign = alarms = 0
    for c in cases:
        g, pl, fd, kn = grade_pairing(c)
        for i, v in enumerate((g, pl, fd, kn)):
            tot[i] += v
        r = c.result
        first = r.first.pair.label if r.first else "-"
        verdict = ""
        if c.kind == "bug":
            bugs += 1
            ok = first_right(c)
            right += ok
            verdict = "right" if ok else "WRONG"
        else:
            benign += 1
            alarms += r.first is not None
            verdict = "FALSE ALARM" if r.first is not None else "quiet"
        un = f"{len(r.pairing.unpaired_ref)}/{len(r.pairing.unpaired_cand)}"
        print(f"{c.family:8} {c.pair[:24]:24} {c.name[:26]:26} {c.kind:6} {len(r.pairing.pairs):5d} "
              f"{g / max(pl, 1):6.1%} {fd / max(kn, 1):6.1%} {un:>9}  {verdict}: {first[:70]}")
    return {"tot": tot, "bugs": bugs, "right": right, "benign": benign, "alarms": alarms}


def summary(cases: list[Case], s: dict, seconds: float) -> None:
    tot, bugs, right, benign, alarms = s["tot"], s["bugs"], s["right"], s["benign"], s["alarms"]
    print()
    print(f"cases: {len(cases)} ({bugs} bugs, {benign} benign) in {seconds:.0f} s; families: "
          f"{len({c.family for c in cases})}")
    print(f"pairing precision {tot[0] / max(tot[1], 1):.1%}  recall {tot[2] / max(tot[3], 1):.1%}")
    print(f"first divergent pair right: {right}/{bugs} = {right / max(bugs, 1):.0%}")
    print(f"false alarms on benign variants: {alarms}/{benign} = {alarms / max(benign, 1):.0%}")


def main() -> None:
    t0 = time.perf_counter()
    compile_ok = "--no-compile" not in sys.argv
    cases = llama_cases(compile_ok) + bert_cases() + conv_cases(compile_ok) + moe_cases() + own_cases()
    run_cases(cases)
    s = report(cases)
    t_cases = time.perf_counter() - t0
    # 32 layers, one step: capture both implementations and diff them
    cfg = M.llama_config(32)
    hf = M.hf_llama(cfg)
    mine = M.load_from_hf(M.MyLlama(cfg), hf)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    t1 = time.perf_counter()
    a, b = capture(hf, x), capture(mine, x)
    t2 = time.perf_counter()
    big = diff_records(a, b)
    t3 = time.perf_counter()
    summary(cases, s, t_cases)
    print(f"32-layer Llama vs rewrite, 1 step: capture {t2 - t1:.1f} s + diff {t3 - t2:.1f} s = {t3 - t1:.1f} s "
          f"({len(big.pairing.pairs)} pairs, {len(big.pairing.unpaired_ref)}/{len(big.pairing.unpaired_cand)} "
          f"unpaired, first divergent: {big.first.pair.label if big.first else 'none'})")


if __name__ == "__main__":
    main()
