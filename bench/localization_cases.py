"""The extended localization corpus of ``bench/localization.py``: healthy controls, failures whose first
non-finite value is not their origin, and the kinds ``quiet-loss``, ``fp8-outlier``, ``buffer``,
``tied-weight``, ``backward-only``, ``mask-constant`` and ``report`` (failures rebuilt from public reports,
each with its source).  Every model is built from config or from code with random weights; nothing is
downloaded.

A ``Case`` says how to build the model and its inputs, the candidate policy, an optional loss (the run is then
forward + backward), which input kinds answer it, and what the right answer is (``expect``; None for a healthy
control):

- ``{"origin": "op", "module": m, "types": {...} | None, "backward": bool}``: the named op must be an op of
  module ``m`` itself (a live capture's ``m.<fn>.<n>`` or ``m.forward.<n>``, or for ``backward`` its
  ``.backward`` op; a dump's ``model.m`` or ``model.m.backward``), of one of ``types`` when given (live only:
  a dump names modules, not the ops inside them);
- ``{"origin": "parameter", "params": {...}}``: a parameter (or buffer) of one of these names;
- ``{"quiet": True, "module": m, "types": {...}}``: no NaN or inf anywhere; right when the op ranked first by
  local error, or a diagnosis, names an op of module ``m`` (of one of ``types`` when given); with ``"rule"``,
  only a diagnosis of that rule counts.

``"cause": {"rule": r, "types": {...}}`` beside an origin (live only): the run's diagnoses must also name an op
of one of ``types`` (any op when None) with rule ``r``: the op where the failure started when it is not the one
that wrote the first NaN (a variance that cancelled below zero before ``rsqrt``), or the mechanism that carried
it on (Adam's state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from precision_lab.fixes.policy import first_tensor

FP16_MAX = float(torch.finfo(torch.float16).max)
DUMPS = ("dump-ordered", "dump-unordered")
ALL_HOWS = ("live",) + DUMPS


@dataclass
class Case:
    name: str
    kind: str
    build: Callable[[], nn.Module]
    inputs: Any
    dtype: Any = torch.float16           # a torch dtype or a precision policy
    loss: Optional[Callable] = None      # forward + backward when given
    expect: Optional[dict] = None        # None: a healthy control
    hows: tuple = ALL_HOWS
    source: str = ""                     # the public report a rebuilt failure follows
    note: str = ""
    runner: Optional[Callable] = None    # a custom live run: (store) -> (first_nonfinite, extra)
    fp32_control: bool = False           # a healthy control whose fp32 reference is scored as its own row


def _loss(out):
    return first_tensor(out).float().pow(2).mean()


# ---- architectures (transformers, from config, eager attention) ------------------------------------

def hf(name: str):
    """(build, target template, inputs with a padding attention_mask) of a small transformers model."""
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    dec = dict(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    if name == "qwen2":
        cfg, cls, t = tf.Qwen2Config(**dec, **small), tf.Qwen2ForCausalLM, "model.layers.{i}.mlp.gate_proj"
    elif name == "llama":
        cfg, cls, t = tf.LlamaConfig(**dec, **small), tf.LlamaForCausalLM, "model.layers.{i}.mlp.up_proj"
    elif name == "mistral":
        cfg, cls, t = (tf.MistralConfig(sliding_window=None, **dec, **small), tf.MistralForCausalLM,
                       "model.layers.{i}.mlp.up_proj")
    elif name == "gemma":
        cfg, cls, t = (tf.GemmaConfig(head_dim=16, **dec, **small), tf.GemmaForCausalLM,
                       "model.layers.{i}.mlp.up_proj")
    elif name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            attn_implementation="eager")
        cls, t = tf.GPT2LMHeadModel, "transformer.h.{i}.mlp.c_fc"
    elif name == "gpt_neox":
        cfg = tf.GPTNeoXConfig(intermediate_size=128, max_position_embeddings=64, attn_implementation="eager",
                               **small)
        cls, t = tf.GPTNeoXForCausalLM, "gpt_neox.layers.{i}.mlp.dense_h_to_4h"
    elif name == "opt":
        cfg = tf.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                           max_position_embeddings=64, word_embed_proj_dim=64, attn_implementation="eager")
        cls, t = tf.OPTForCausalLM, "model.decoder.layers.{i}.fc1"
    elif name == "bert":
        cfg = tf.BertConfig(intermediate_size=128, max_position_embeddings=64, attn_implementation="eager", **small)
        cls, t = tf.BertModel, "encoder.layer.{i}.intermediate.dense"
    elif name == "t5":
        cfg = tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, attn_implementation="eager")
        cls, t = tf.T5ForConditionalGeneration, "encoder.block.{i}.layer.1.DenseReluDense.wi"
    else:
        raise KeyError(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    if name in ("bert", "t5"):
        mask[0, -5:] = 0        # right padding: the extended mask holds finfo.min
    else:
        mask[0, :5] = 0         # left padding: pad queries see nothing but themselves or nothing at all
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(1, 128, (2, 8), generator=g)
    return (lambda: cls(cfg)), t, inputs


HF_ARCHS = ("qwen2", "llama", "gpt2", "bert", "t5", "mistral", "gpt_neox", "opt", "gemma")


# ---- seed models ---------------------------------------------------------------------------------

class MaskedAttention(nn.Module):
    """One causal attention whose mask is made by ``how``; ``hooked``: its masked scores pass a hook point
    (``hook_scores``, TransformerLens-style), so a hook dump records them."""

    def __init__(self, d=32, how="masked_fill", hooked=False):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.how = how
        if hooked:
            self.hook_scores = HookPoint()

    def forward(self, x):
        t = x.shape[1]
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        if self.how == "masked_fill":
            s = s.masked_fill(future, float("-inf"))
        elif self.how == "where":
            s = torch.where(~future, s, torch.tensor(float("-inf"), dtype=s.dtype))
        elif self.how == "finfo32-add":
            # the HF idiom with the fp32 constant: in fp16 the product is -inf, the output still finite and right
            s = s + future.to(s.dtype) * torch.finfo(torch.float32).min
        elif self.how == "full_like":
            s = s + torch.full_like(s, float("-inf")).triu(1)
        elif self.how == "new_full":
            s = s + s.new_full((t, t), float("-inf")).triu(1)
        else:
            raise KeyError(self.how)
        if hasattr(self, "hook_scores"):
            s = self.hook_scores(s)
        return self.out(torch.softmax(s, -1) @ self.v(x))


class SeedAttention(nn.Module):
    def __init__(self, how="masked_fill", hooked=False):
        super().__init__()
        self.layers = nn.ModuleList([MaskedAttention(how=how, hooked=hooked), MaskedAttention(how=how, hooked=hooked)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class SeedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _x(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _with(build, edit):
    """A build() that applies ``edit(model)`` under no_grad (the same every call)."""
    def b():
        torch.manual_seed(0)
        m = build()
        with torch.no_grad():
            edit(m)
        return m
    return b


def _call(model, inputs):
    with torch.no_grad():
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _absmax(build, inputs, path) -> float:
    torch.manual_seed(0)
    m = build()
    got = {}
    h = m.get_submodule(path).register_forward_hook(lambda _m, _i, o: got.__setitem__("a", float(o.abs().max())))
    _call(m, inputs)
    h.remove()
    return got["a"]


def _scale_output(build, inputs, path, factor=2.0):
    """``build`` with module ``path``'s weight and bias scaled so its fp32 output reaches ``factor`` x fp16 max."""
    k = factor * FP16_MAX / _absmax(build, inputs, path)
    torch.manual_seed(0)
    assert float(build().get_submodule(path).weight.detach().abs().max()) * k < FP16_MAX, f"{path}'s weight would overflow"

    def edit(m):
        mod = m.get_submodule(path)
        mod.weight.mul_(k)
        if getattr(mod, "bias", None) is not None:
            mod.bias.mul_(k)
    return _with(build, edit)


# ---- healthy controls ----------------------------------------------------------------------------

def controls(quick: bool) -> list[Case]:
    out = []
    archs = HF_ARCHS + ("seed-attention", "seed-blocks")
    for arch in archs:
        if arch == "seed-attention":
            build, inputs = SeedAttention, _x(2, 16, 32)
        elif arch == "seed-blocks":
            build, inputs = SeedBlocks, _x(4, 16)
        else:
            build, _, inputs = hf(arch)
        for dt, dname in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            for bwd in (False, True):
                out.append(Case(f"{arch}/{dname}/{'fwd+bwd' if bwd else 'fwd'}", "healthy", build, inputs, dt,
                                loss=_loss if bwd else None, fp32_control=dname == "fp16"))
    for how in ("masked_fill", "where", "finfo32-add", "full_like", "new_full"):
        for dt, dname in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            out.append(Case(f"mask-{how}/{dname}", "mask-constant", (lambda h=how: SeedAttention(h, hooked=True)),
                            _x(2, 16, 32), dt, fp32_control=dname == "fp16"))
    return out


# ---- failures whose first non-finite value (in execution order) is not their origin ----------------

class SharedNaNThenOverflow(nn.Module):
    """A side branch that is NaN in fp32 as much as in fp16 (L2 normalisation of an all-zero padding row,
    then zeroed), before a Linear whose output overflows fp16 only."""

    def __init__(self):
        super().__init__()
        self.side = nn.Identity()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        n = x / x.norm(dim=-1, keepdim=True)          # 0/0 on the padding row, in every run
        x = x + torch.nan_to_num(n, nan=0.0) * 0.0
        return self.fc(x)


class LogMaskThenOverflow(nn.Module):
    """log_softmax over masked scores (-inf at the masked places, in every run), then a Linear that overflows
    fp16 on the finite part."""

    def __init__(self):
        super().__init__()
        self.attn = MaskedAttention()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        t = x.shape[1]
        s = x @ x.transpose(-1, -2)
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        lp = torch.log_softmax(s, -1)                  # -inf where masked, in the reference too
        w = lp.exp()                                   # finite again
        return self.fc(w @ x + self.attn(x))


def not_first(quick: bool) -> list[Case]:
    out = []
    # an fp16 -inf mask written by a mul (the finfo(float32).min idiom), then a real overflow in the next layer
    b = _scale_output(lambda: SeedAttention("finfo32-add"), _x(2, 16, 32), "layers.1.out")
    out.append(Case("finfo32-mask-then-overflow", "not-first", b, _x(2, 16, 32),
                    expect={"origin": "op", "module": "layers.1.out", "types": {"linear", "Linear"}},
                    note="layers.0 mask: mul(bool, finfo(fp32).min) -> -inf in fp16"))
    for how in ("where", "full_like"):
        b = _scale_output(lambda h=how: SeedAttention(h), _x(2, 16, 32), "layers.1.out")
        out.append(Case(f"{how}-mask-then-overflow", "not-first", b, _x(2, 16, 32),
                        expect={"origin": "op", "module": "layers.1.out", "types": {"linear", "Linear"}}))
    x = _x(2, 8, 32)
    x[0, 0] = 0.0
    b = _scale_output(SharedNaNThenOverflow, x, "fc")
    out.append(Case("reference-shares-nan-then-overflow", "not-first", b, x,
                    expect={"origin": "op", "module": "fc", "types": {"linear", "Linear"}},
                    note="the fp32 reference has the same 0/0 NaN first"))
    b = _scale_output(LogMaskThenOverflow, _x(2, 8, 32), "fc")
    out.append(Case("log-softmax-mask-then-overflow", "not-first", b, _x(2, 8, 32),
                    expect={"origin": "op", "module": "fc", "types": {"linear", "Linear"}},
                    note="log_softmax writes -inf in both runs first"))
    for arch, path in (("llama", "model.layers.1.mlp.up_proj"), ("bert", "encoder.layer.1.intermediate.dense"),
                       ("gpt2", "transformer.h.1.mlp.c_fc"))[: 2 if quick else 3]:
        build, _, inputs = hf(arch)
        out.append(Case(f"{arch}-padmask-then-overflow", "not-first", _scale_output(build, inputs, path), inputs,
                        expect={"origin": "op", "module": path, "types": None},
                        note="padding attention_mask (finfo.min) built first, overflow in layer 1"))
    return out


# ---- new kinds ------------------------------------------------------------------------------------

class OnePassVar(nn.Module):
    """Normalisation with the one-pass variance E[x^2] - E[x]^2 on rows with a large common mean: no NaN
    (clamped at 0), but the subtraction cancels every significant bit in bf16."""

    def __init__(self, mean=300.0):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.norm = nn.Identity()
        self.mean = mean

    def forward(self, x):
        x = self.inp(x) * 0.1 + self.mean
        m = x.mean(-1, keepdim=True)
        v = ((x * x).mean(-1, keepdim=True) - m * m).clamp_min(0)
        return (x - m) / torch.sqrt(v + 1e-3)


class Absorb(nn.Module):
    """A large bias added and taken away again: (x + 2048) - 2048 keeps none of x's low bits in fp16."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        h = self.inp(x)
        h = (h + 2048.0) - 2048.0
        return self.out(h)


class PositionsByCumsum(nn.Module):
    """Position ids counted in the compute dtype (``mask.cumsum``): past 2048 fp16 holds only even integers,
    and rotary angles of the wrong position follow (sonos/tract#2587, numpy#22208)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)

    def forward(self, x):
        ones = torch.ones(x.shape[0], x.shape[1], dtype=x.dtype)
        pos = ones.cumsum(-1)                          # 1, 2, ..., 3000 in the input's dtype
        ang = pos[..., None] * self.inv_freq.to(x.dtype)
        rot = torch.cat([ang.cos(), ang.sin()], -1)
        return self.proj(x * rot)


class TinyGrad(nn.Module):
    """A loss scaled far down (a mean over many elements times a small weight): its gradients fall below
    fp16's smallest subnormal and become exactly 0 (huggingface/diffusers#13539)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * 1e-4


class TokenPool(nn.Module):
    """Mean pooling that counts its tokens in the dtype of its own projection, one add of 1 per token, from a
    count already at 2040 (NVIDIA/cutlass#1521: a half counter sticks at 2048)."""

    def __init__(self, start=2040):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.start = start

    def forward(self, x):
        h = self.proj(x)
        count = torch.full((x.shape[0], 1, 1), float(self.start), dtype=h.dtype)
        total = h[:, :1] * self.start
        for t in range(x.shape[1]):
            count = count + 1.0
            total = total + h[:, t:t + 1]
        return total / count


class TokenCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = TokenPool()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.pool(x)[:, 0])


def _tiny_loss(out):
    return out.float().mean() * 1e-4


def quiet(quick: bool) -> list[Case]:
    return [
        Case("onepass-variance-bf16", "quiet-loss", OnePassVar, _x(4, 32), torch.bfloat16,
             expect={"quiet": True, "module": "", "types": {"sub"}}, hows=("live",),
             note="(x*x).mean() - m*m at mean 300 in bf16"),
        Case("onepass-variance-fp16", "quiet-loss", (lambda: OnePassVar(100.0)), _x(4, 32), torch.float16,
             expect={"quiet": True, "module": "", "types": {"sub"}}, hows=("live",),
             note="(x*x).mean() - m*m at mean 100 in fp16"),
        Case("absorb-2048-fp16", "quiet-loss", Absorb, _x(4, 32), torch.float16,
             expect={"quiet": True, "module": "", "types": {"add"}, "rule": "absorption"}, hows=("live",),
             note="(h + 2048) - 2048: the add rounds h to fp16's spacing 2 at 2048 (its bits are lost there); the "
                  "subtraction is exact (operands within 2x: Sterbenz) and only shows it"),
    ]


class QuantMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < 2:
                x = torch.relu(x)
        return x


def fp8(quick: bool) -> list[Case]:
    from precision_lab.fixes.policy import get_policy

    pol = get_policy("fp8-e4m3-tensor")

    def weight_outlier(m):
        m.layers[1].weight[0, 0] = 3.0e4

    def act_outlier(m):
        # one input channel of layers.1 (an output row of layers.0) much larger than the rest
        m.layers[0].weight[5].mul_(2.0e4)
        m.layers[0].weight[5].abs_()
        m.layers[0].bias[5] = 1.0

    return [
        Case("fp8-weight-outlier", "fp8-outlier", _with(QuantMLP, weight_outlier), _x(4, 32).abs(), pol,
             expect={"quiet": True, "module": "layers.1.weight_quant", "types": None, "any_nonfinite": True},
             hows=("live",), note="layers.1.weight[0,0] = 3e4: the per-tensor scale flushes the other weights"),
        Case("fp8-activation-outlier", "fp8-outlier", _with(QuantMLP, act_outlier), _x(4, 32).abs(), pol,
             expect={"quiet": True, "module": "layers.1.act_quant", "types": None, "any_nonfinite": True},
             hows=("live",), note="one channel of layers.1's input ~3e4, the rest ~0.3"),
    ]


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def _eval(build):
    def b():
        m = build()
        m.eval()
        return m
    return b


def buffers(quick: bool) -> list[Case]:
    out = []
    for buf in ("running_var", "running_mean"):
        def edit(m, buf=buf):
            getattr(m.bn, buf)[3] = 1e5
        out.append(Case(f"batchnorm-{buf}", "buffer", _eval(_with(BNNet, edit)), _x(4, 8),
                        expect={"origin": "parameter", "params": {f"bn.{buf}"}},
                        note=f"bn.{buf}[3] = 1e5 (inf in fp16), model in eval mode"))
    return out


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


def tied(quick: bool) -> list[Case]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = 3
    out = [Case("seed-tied-used-row", "tied-weight", _with(TiedLM, lambda m: m.embed.weight[3].__setitem__(0, 1e5)),
                ids, expect={"origin": "parameter", "params": {"embed.weight", "lm_head.weight"}},
                note="embed.weight[3,0] = 1e5, token 3 in the input"),
           Case("seed-tied-unused-row", "tied-weight",
                _with(TiedLM, lambda m: m.embed.weight[63].__setitem__(0, 1e5)),
                ids.clamp(max=62), expect={"origin": "parameter", "params": {"embed.weight", "lm_head.weight"}},
                note="embed.weight[63,0] = 1e5, token 63 never looked up: only lm_head reads it")]
    build, _, inputs = hf("gpt2")
    out.append(Case("gpt2-tied-wte", "tied-weight",
                    _with(build, lambda m: m.transformer.wte.weight[int(inputs["input_ids"][1, 0])].__setitem__(0, 1e5)),
                    inputs, expect={"origin": "parameter", "params": {"transformer.wte.weight", "lm_head.weight"}},
                    note="transformer.wte.weight (tied to lm_head) element 1e5"))
    return out


class BackwardOverflow(nn.Module):
    """Forward finite (small activations); under a loss scale of 64 the gradient into ``mid``'s input sums 64
    products of 3000 x 8 and overflows fp16."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.mid = nn.Linear(64, 64)
        self.c = nn.Linear(64, 8)

    def forward(self, x):
        return self.c(self.mid(torch.relu(self.a(x))))


def _bo_edit(m):
    m.a.weight.mul_(1e-3)
    m.a.bias.zero_()
    m.mid.weight.fill_(3000.0)
    m.mid.bias.zero_()
    m.c.weight.fill_(1.0 / 64)
    m.c.bias.zero_()


def _scaled_sum(o):
    return o.float().sum() * 64.0      # a loss scale of 64, as a GradScaler applies


def backward(quick: bool) -> list[Case]:
    return [Case("backward-grad-input-overflow", "backward-only", _with(BackwardOverflow, _bo_edit), _x(4, 64).abs(),
                 loss=_scaled_sum,
                 expect={"origin": "op", "module": "mid", "types": {"linear", "Linear"}, "backward": True},
                 note="mid.weight = 3000, loss scale 64: forward finite, mid's grad_input 64*3000*8 > 65504")]


# ---- failures rebuilt from public reports -----------------------------------------------------------

class Fp16ScaleQuant(nn.Module):
    """Per-tensor fp8 fake quantisation with the scale computed in fp16 and a 1e-12 amax floor (0 in fp16): tiny
    activations give a subnormal scale whose reciprocal overflows; 0 x inf = NaN on the zeros."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.quant = nn.Identity()
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        h = torch.relu(self.inp(x)) * 1e-3            # amax ~ 7e-4
        amax = h.abs().amax().clamp(min=1e-12)
        scale = amax / 448.0
        inv = scale.reciprocal()
        q = (h * inv).clamp(-448, 448).to(torch.float8_e4m3fn).to(h.dtype) * scale
        return self.out(q)


class NaiveSoftmaxAttention(nn.Module):
    """Attention whose softmax is exp(s) / sum(exp(s)) with no max subtracted, on scores above ln(65504)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.soft = nn.Identity()

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        e = torch.exp(s)
        return (e / e.sum(-1, keepdim=True)) @ self.v(x)


class OnePassLNbf16(nn.Module):
    """LayerNorm with E[x^2] - E[x]^2 in bf16 on rows of mean ~130 and spread ~3: the difference cancels to a
    negative number (-128 on one row) and rsqrt gives NaN (tenstorrent/tt-metal#45968, onnxruntime#21935, mlx#2238)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.Identity()

    def forward(self, x):
        x = x * 3.0 + 130.0
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) * torch.rsqrt(v + 1e-5)


class TinyEpsLN(nn.Module):
    """LayerNorm statistics in the compute dtype with eps 1e-12 (0 in fp16): a zero padding row gives
    0 x rsqrt(0) = NaN (deepspeedai/DeepSpeed#581, pytorch#41527)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)

    def forward(self, x):
        h = self.inp(x) * (x.abs().sum(-1, keepdim=True) > 0)     # padding rows stay zero
        m = h.mean(-1, keepdim=True)
        c = h - m
        return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-12)


def _adam_runner(build, inputs):
    """Two training steps of an fp16 model with Adam: step 0's gradient overflows to +inf, Adam's state and the
    weights become NaN, step 1 is NaN from its first op.  The right answer is step 0's backward op."""

    def run(store):
        from precision_lab import capture
        from precision_lab.live import CaptureOptions
        from precision_lab.services.report import first_nonfinite
        from precision_lab.store import queries as q

        torch.manual_seed(0)
        model = build()
        with capture(model, run="fp16-adam", store=store, dtype_policy=torch.float16,
                     options=CaptureOptions()) as cap:
            opt = torch.optim.Adam(cap.model.parameters(), lr=1e-3, eps=1e-4)
            for _ in range(2):
                opt.zero_grad()
                out = cap.model(cap.prepare_inputs(inputs))
                _scaled_sum(out).backward()
                opt.step()
                cap.step()
        run_row = q.session_runs(store, store.session(cap.session).session_id)[0]
        return first_nonfinite(store, run_row.run_id)
    return run


def _inmax(build, inputs, path) -> float:
    torch.manual_seed(0)
    m = build()
    got = {}
    h = m.get_submodule(path).register_forward_pre_hook(
        lambda _m, a: got.__setitem__("a", float(a[0].detach().abs().max())))
    _call(m, inputs)
    h.remove()
    return got["a"]


def _down_proj_overflow(build, inputs, mlp):
    """down_proj's weight scaled by 1000 (still far inside fp16) and gate_proj and up_proj alike, so that
    down_proj's fp32 output reaches 2 x fp16 max while its input (act(gate) x up) stays inside fp16's range."""
    k = 2 * FP16_MAX / _absmax(build, inputs, f"{mlp}.down_proj")
    kd = min(k, 1000.0)
    ku = math.sqrt(k / kd)

    def edit(m):
        m.get_submodule(f"{mlp}.down_proj").weight.mul_(kd)
        for p in ("gate_proj", "up_proj"):
            m.get_submodule(f"{mlp}.{p}").weight.mul_(ku)
    b = _with(build, edit)
    assert _inmax(b, inputs, f"{mlp}.down_proj") < FP16_MAX < _absmax(b, inputs, f"{mlp}.down_proj")
    return b


def reports(quick: bool) -> list[Case]:
    from precision_lab.fixes.policy import get_policy

    out = []
    x = _x(4, 32)
    out.append(Case("fp16-fp8-scale-reciprocal", "report", Fp16ScaleQuant, x,
                    expect={"origin": "op", "module": "", "types": {"reciprocal"}},
                    source="https://github.com/pytorch/ao/issues/4713 ; https://github.com/vipshop/cache-dit/pull/1097",
                    note="amax 7e-4 in fp16: scale 1.6e-6 (subnormal), reciprocal 6.4e5 -> inf, 0*inf NaN"))
    z = _x(4, 8, 32)
    z[0, 2] = 0.0                                       # an all-zero (padding) row
    out.append(Case("fp8-row-scale-zero-row", "report", QuantMLP, z, get_policy("fp8-e4m3-row"),
                    expect={"origin": "op", "module": "layers.0.act_quant.inv_scale", "types": {"reciprocal"}},
                    hows=("live",),
                    source="https://github.com/huggingface/kernels-community/issues/681",
                    note="row-wise fp8: the zero row's amax 0 -> scale 0 -> reciprocal inf -> 0*inf NaN"))
    out.append(Case("fp16-softmax-no-max", "report", _with(NaiveSoftmaxAttention, lambda m: m.q.weight.mul_(4.0)),
                    _x(2, 8, 32), expect={"origin": "op", "module": "", "types": {"exp"}},
                    source="https://github.com/NVIDIA/FasterTransformer/issues/43",
                    note="exp(scores) with scores > 11.09 overflows fp16"))
    out.append(Case("bf16-onepass-layernorm", "report", OnePassLNbf16, _x(4, 32), torch.bfloat16,
                    expect={"origin": "op", "module": "", "types": {"rsqrt"},
                            "cause": {"rule": "error-amplified", "types": {"sub"}}},
                    source="https://github.com/tenstorrent/tt-metal/issues/45968",
                    note="E[x^2]-E[x]^2 at mean 130 in bf16 is -128 on one row; rsqrt(negative) is where the NaN appears, "
                         "the subtraction is where it started"))
    zx = _x(4, 32)
    zx[1] = 0.0
    out.append(Case("fp16-layernorm-eps-1e-12", "report", TinyEpsLN, zx,
                    expect={"origin": "op", "module": "", "types": {"rsqrt"}},
                    source="https://github.com/deepspeedai/DeepSpeed/issues/581",
                    note="eps 1e-12 is 0 in fp16: rsqrt(0) = inf on the zero row, then 0*inf"))
    qb, _, qin = hf("qwen2")
    path = "model.layers.1.mlp.down_proj"
    out.append(Case("qwen2-down-proj-fp16", "report", _down_proj_overflow(qb, qin, "model.layers.1.mlp"), qin,
                    expect={"origin": "op", "module": path, "types": None},
                    source="https://github.com/QwenLM/Qwen3/issues/761",
                    note="down_proj output above 65504 in fp16, after the padding mask"))
    out.append(Case("fp16-positions-past-2048", "quiet-loss", PositionsByCumsum, _x(1, 3000, 16),
                    expect={"quiet": True, "module": "", "types": {"cumsum"}}, hows=("live",),
                    source="https://github.com/sonos/tract/pull/2587 ; https://github.com/numpy/numpy/issues/22208",
                    note="cumsum of ones in fp16: 2049 -> 2048, 2051 -> 2052, then cos/sin of the wrong angle"))
    out.append(Case("fp16-grad-underflow", "quiet-loss", TinyGrad, _x(4, 32), loss=_tiny_loss,
                    expect={"quiet": True, "module": "", "types": {"mul"}, "rule": "gradient-underflow"},
                    hows=("live",),
                    source="https://github.com/huggingface/diffusers/pull/13539",
                    note="grads ~1e-9 < fp16's 6e-8: the backward of the final mul writes zeros"))
    out.append(Case("fp16-token-counter-2048", "quiet-loss", TokenCounter, _x(2, 24, 16),
                    expect={"quiet": True, "module": "pool", "types": {"add"}, "rule": "integer-limit"},
                    hows=("live",),
                    source="https://github.com/NVIDIA/cutlass/issues/1521 ; https://github.com/pytorch/pytorch/issues/17584",
                    note="a token count kept in fp16 from 2040: 2048 + 1 rounds back to 2048, 16 of 24 adds lost"))
    out.append(Case("fp16-grad-inf-adam-nan", "report", _with(BackwardOverflow, _bo_edit), _x(4, 64).abs(),
                    expect={"origin": "op", "module": "mid", "types": {"linear", "Linear"}, "backward": True,
                            "cause": {"rule": "optimizer-nonfinite", "types": None}},
                    hows=("live",), source="https://github.com/deepspeedai/DeepSpeed/pull/8035 ; "
                                           "https://github.com/NVIDIA/apex/issues/240",
                    note="step 0: mid's grad_input +inf; Adam turns weights NaN; step 1 NaN from its first op"))
    out[-1].runner = _adam_runner(out[-1].build, out[-1].inputs)
    return out


# ---- healthy runs that hold intended non-finite values, and failures that must not be excused ----------

class Fill(nn.Module):
    """``masked_fill`` of a mask with ``value``, as its own module (so a hook dump records what it writes)."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x, mask):
        return x.masked_fill(mask, self.value)


class NearestNeighbour(nn.Module):
    """Nearest-neighbour search: a point's distance to itself excluded with ``+inf`` (``masked_fill``), then
    ``min`` and ``argmin`` over the row; the result is finite."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.out, self.exclude_self = nn.Linear(d, d), nn.Linear(d, d), Fill(float("inf"))

    def forward(self, x):
        h = self.proj(x)
        dist = (h[:, None, :] - h[None, :, :]).pow(2).sum(-1)
        masked = self.exclude_self(dist, torch.eye(h.shape[0], dtype=torch.bool, device=h.device))
        nearest = masked.min(-1).values
        j = masked.argmin(-1)
        return self.out(h + h[j] * 0.1) * (1 + 0.01 * nearest[:, None])


class MaskedMaxPool(nn.Module):
    """Max-pooling over a sequence whose padding positions are ``-inf`` (``masked_fill``), ``amax`` and ``argmax``;
    every sequence has a real token, so the pooled values are finite."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.out, self.pad = nn.Linear(d, d), nn.Linear(d, d), Fill(float("-inf"))

    def forward(self, x):
        h = self.proj(x)
        pad = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        pad[:, -3:] = True
        filled = self.pad(h, pad[..., None])
        pooled = filled.amax(1) + 0.0 * filled.argmax(1).to(h.dtype)
        return self.out(pooled)


class PLogP(nn.Module):
    """``p * log(p)``: ``log(0)`` is ``-inf`` and ``0 x -inf`` NaN where p is 0."""

    def forward(self, p):
        return p * torch.log(p)


class LogZeroEntropy(nn.Module):
    """The entropy of a distribution with exact zeros: ``p log p`` is NaN where p is 0, dropped by ``where``; the
    result is finite."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.out, self.plogp = nn.Linear(d, d), nn.Linear(d, d), PLogP()

    def forward(self, x):
        h = self.proj(x)
        p = torch.relu(h)
        p = p / (p.sum(-1, keepdim=True) + 1)
        ent = -torch.where(p > 0, self.plogp(p), torch.zeros_like(p)).sum(-1, keepdim=True)
        return self.out(h) + ent


class RowScale(nn.Module):
    """Each row divided by its largest magnitude: ``0 / 0`` = NaN on an all-zero row."""

    def forward(self, h):
        return h / h.abs().amax(-1, keepdim=True)


class NanToNum(nn.Module):
    """Scales rows, two of which are all zero (NaN), then ``nan_to_num``: finite."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.out, self.scale = nn.Linear(d, d), nn.Linear(d, d), RowScale()

    def forward(self, x):
        h = self.proj(x)
        h = h * (torch.arange(h.shape[0], device=h.device) >= 2).to(h.dtype)[:, None]
        return self.out(torch.nan_to_num(self.scale(h), nan=0.0))


class InfPad(nn.Module):
    """Pads a sequence with two ``+inf`` steps (``F.pad``)."""

    def forward(self, h):
        return torch.nn.functional.pad(h, (0, 0, 0, 2), value=float("inf"))


class InfPadSliced(nn.Module):
    """Pads a sequence with ``+inf``, takes a running minimum over it and drops the padding by indexing before it
    is used: finite."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.out, self.pad = nn.Linear(d, d), nn.Linear(d, d), InfPad()

    def forward(self, x):
        h = self.proj(x)
        run = self.pad(h).cummin(1).values
        return self.out(run[:, : h.shape[1]])


class HookPoint(nn.Identity):
    """TransformerLens's ``HookPoint``: an identity module that exists to be hooked."""


class HookPointAttention(nn.Module):
    """A TransformerLens-style causal attention: scores masked with an ``IGNORE`` buffer of ``-inf`` by
    ``where``, recorded by the hook points ``hook_attn_scores`` and ``hook_pattern``."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.hook_attn_scores, self.hook_pattern, self.hook_z = HookPoint(), HookPoint(), HookPoint()
        self.register_buffer("IGNORE", torch.tensor(float("-inf")))

    def forward(self, x):
        t = x.shape[1]
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        s = self.hook_attn_scores(torch.where(future, self.IGNORE.to(s.dtype), s))
        p = self.hook_pattern(torch.softmax(s, -1))
        return self.o(self.hook_z(p @ self.v(x)))


class LogMask(nn.Module):
    """An additive mask made by the user's own arithmetic: ``log`` of a 0/1 keep mask (0 where masked -> ``-inf``)."""

    def forward(self, keep, dtype):
        return torch.log(keep.to(dtype))


class LogMaskAttention(nn.Module):
    """A causal attention whose additive mask is ``log(keep)``: ``-inf`` above the diagonal, never a full row."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mask = LogMask()

    def forward(self, x):
        t = x.shape[1]
        keep = torch.tril(torch.ones(t, t, device=x.device))
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1]) + self.mask(keep, x.dtype)
        return self.o(torch.softmax(s, -1) @ self.v(x))


class Stack(nn.Module):
    """``first`` then ``then`` (a Linear, scaled to overflow in the failing cases)."""

    def __init__(self, first: nn.Module, d: int):
        super().__init__()
        self.first, self.fc = first, nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x + self.first(x))


class PadMask(nn.Module):
    """``transformers``' additive padding mask: ``(1 - keep) * finfo(float32).min`` in the compute dtype: finite in
    fp32, ``-inf`` in fp16."""

    def forward(self, keep, dtype):
        return (1.0 - keep[:, None, None, :].to(dtype)) * torch.finfo(torch.float32).min


class PaddedAttention(nn.Module):
    """A bidirectional attention over a batch with a padding mask; sequence 1 is padded throughout (its keep mask
    is all zeros), so in fp16 its every score is ``-inf`` and its softmax row NaN; the fp32 run is finite."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.pad_mask, self.heads = PadMask(), heads
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        keep = torch.ones(b, t, dtype=torch.long, device=x.device)
        keep[0, -3:] = 0
        keep[1] = 0
        bias = self.pad_mask(keep, x.dtype)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        s = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        a = (torch.softmax(s, -1) @ split(self.v(x))).transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.o(a))


class LogProbs(nn.Module):
    """``log(softmax(x))`` computed as two ops: a probability below fp16's smallest subnormal is 0 in fp16 and its
    log ``-inf``; in fp32 it is about 1e-12 and its log finite."""

    def forward(self, h):
        return torch.log(torch.softmax(h * 6.0, -1))


class LogUnderflow(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj, self.logp, self.out = nn.Linear(d, d), LogProbs(), nn.Linear(d, d)

    def forward(self, x):
        return self.out(self.logp(self.proj(x)))


class InfFill(nn.Module):
    """Fills the padding positions with ``+inf``, meant for a ``min`` that never comes."""

    def forward(self, h):
        pad = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        pad[:, -2:] = True
        return h.masked_fill(pad[..., None], float("inf"))


class PlusInfReachesOutput(nn.Module):
    """A ``+inf`` fill that is averaged into the output (in fp32 as much as in fp16): a failure, not a mask."""

    def __init__(self, d=16):
        super().__init__()
        self.proj, self.fill, self.out = nn.Linear(d, d), InfFill(), nn.Linear(d, d)

    def forward(self, x):
        return self.out(self.fill(self.proj(x)).mean(1))


class OwnInfConstants(nn.Module):
    """A model's own +-inf constants: buffers of +inf and -inf as the start of a running min and max, and top-k
    slots filled with -inf (``torch.full``) of which two are used; the result is finite."""

    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("HI", torch.tensor(float("inf")))
        self.register_buffer("LO", torch.tensor(float("-inf")))

    def forward(self, x):
        h = self.fc(x)
        lo = torch.minimum(self.HI.to(h.dtype).expand_as(h[:, 0]), h.min(-1).values)
        hi = torch.maximum(self.LO.to(h.dtype).expand_as(h[:, 0]), h.max(-1).values)
        slots = torch.full((h.shape[0], 4), float("-inf"), dtype=h.dtype, device=h.device)
        slots[:, :2] = h.topk(2, -1).values
        return h * (hi - lo)[:, None] + slots.max(-1).values[:, None]


class ArgmaxPick(nn.Module):
    """Picks each row's best allowed column: the others are ``-inf`` (``masked_fill``) before ``argmax``; the
    picked values are finite."""

    def __init__(self, d=16):
        super().__init__()
        self.score, self.block = nn.Linear(d, d), Fill(float("-inf"))

    def forward(self, h):
        s = self.score(h)
        banned = torch.zeros_like(s, dtype=torch.bool)
        banned[..., 1::2] = True
        j = self.block(s, banned).argmax(-1, keepdim=True)
        return h * (1 + 0.01 * s.gather(-1, j))


TAIL_WIDTH = 16
ROWS_TAILS = (NearestNeighbour, LogZeroEntropy, NanToNum, ArgmaxPick)  # on (rows, width); the others on
# (1, rows, width)


class WithIntended(nn.Module):
    """``base`` and then ``tail`` on a projection of its output's rows; the output is ``base``'s plus a small
    finite share of ``tail``'s."""

    def __init__(self, base: nn.Module, tail_cls, width: int):
        super().__init__()
        self.base, self.proj, self.tail = base, nn.Linear(width, TAIL_WIDTH), tail_cls(TAIL_WIDTH)
        self.rows = tail_cls in ROWS_TAILS

    def forward(self, *args, **kwargs):
        h = first_tensor(self.base(*args, **kwargs))
        z = self.proj(h.reshape(-1, h.shape[-1]))
        side = self.tail(z if self.rows else z[None])
        return h + 1e-3 * side.mean()


# the healthy models that hold intended non-finite values, and the input each runs on
INTENDED = {
    "nearest-neighbour-plus-inf-min": (NearestNeighbour, lambda: _x(12, 16)),
    "masked-max-pool-minus-inf-amax": (MaskedMaxPool, lambda: _x(2, 8, 16)),
    "entropy-log-zero-where": (LogZeroEntropy, lambda: _x(4, 16)),
    "nan-to-num-zero-rows": (NanToNum, lambda: _x(6, 16)),
    "inf-padding-dropped-by-index": (InfPadSliced, lambda: _x(2, 8, 16)),
    "hook-point-attn-scores": (HookPointAttention, lambda: _x(2, 8, 32)),
    "log-keep-mask-softmax": (LogMaskAttention, lambda: _x(2, 8, 32)),
    "own-inf-constants-buffers-and-full": (OwnInfConstants, lambda: _x(8, 16)),
}


# transformers models with a tail that holds intended non-finite values (``WithIntended``); the tails whose
# backward stays finite are run forward and backward too (``p * log(p)`` behind ``where`` is not: its gradient
# is 0 x -inf)
HF_TAILS = {"qwen2": (NearestNeighbour, True), "llama": (MaskedMaxPool, True), "gpt2": (InfPadSliced, True),
            "bert": (ArgmaxPick, True), "t5": (LogZeroEntropy, False)}


def _hf_intended(arch: str, tail):
    build, _, inputs = hf(arch)

    def make():
        torch.manual_seed(0)
        base = build()
        with torch.no_grad():
            width = first_tensor(_call(base, inputs)).shape[-1]
        return WithIntended(base, tail, width)

    return make, inputs


def intended(quick: bool) -> list[Case]:
    """Healthy controls whose runs hold non-finite values on purpose (of 8 kinds, with the ``finfo.min``
    padding masks of the ``healthy`` kind), each in fp16 and bf16, the fp16 one's fp32 reference a control of
    its own; and the same intended values before a real overflow, where the overflow is the answer."""
    out = []
    for name, (build, inputs) in INTENDED.items():
        for dt, dname in ((torch.float16, "fp16"),) + (() if quick else ((torch.bfloat16, "bf16"),)):
            out.append(Case(f"{name}/{dname}", "intended-nonfinite", build, inputs(), dt,
                            fp32_control=dname == "fp16"))
    for arch, (tail, backward) in HF_TAILS.items():
        build, inputs = _hf_intended(arch, tail)
        for dt, dname in ((torch.float16, "fp16"),) + (() if quick else ((torch.bfloat16, "bf16"),)):
            for bwd in (False, True) if backward else (False,):
                out.append(Case(f"{arch}+{tail.__name__}/{dname}/{'fwd+bwd' if bwd else 'fwd'}",
                                "intended-nonfinite", build, inputs, dt, loss=_loss if bwd else None,
                                fp32_control=dname == "fp16"))
    d = {"nearest-neighbour-plus-inf-min": 16, "hook-point-attn-scores": 32, "log-keep-mask-softmax": 32,
         "inf-padding-dropped-by-index": 16, "entropy-log-zero-where": 16}
    for name, width in d.items():
        build, inputs = INTENDED[name]
        x = inputs()
        b = _scale_output(lambda bb=build, w=width: Stack(bb(), w), x, "fc")
        out.append(Case(f"{name}-then-overflow", "not-first", b, x,
                        expect={"origin": "op", "module": "fc", "types": {"linear", "Linear"}},
                        note="intended non-finite values first, then an fp16 overflow"))
    return out


def not_excused(quick: bool) -> list[Case]:
    """Failures written by ops that often write intended values: the answer is the op that wrote them."""
    return [
        Case("fully-padded-row-finfo32-mask-fp16", "not-excused", PaddedAttention, _x(2, 8, 32),
             expect={"origin": "op", "module": "pad_mask", "types": {"mul"}},
             note="finfo(fp32).min is -inf in fp16; a fully padded row is all -inf and its softmax NaN"),
        Case("log-softmax-underflow-fp16", "not-excused", LogUnderflow, _x(4, 16, scale=3.0),
             expect={"origin": "op", "module": "logp", "types": {"log"}},
             note="softmax underflows to 0 in fp16, its log is -inf, the next Linear NaN"),
        Case("plus-inf-fill-reaches-output", "not-excused", PlusInfReachesOutput, _x(2, 8, 16),
             expect={"origin": "op", "module": "fill", "types": {"masked_fill"}},
             note="+inf written for a min that never comes is averaged into the output, in fp32 too"),
    ]


def corpus(quick: bool) -> list[Case]:
    return controls(quick) + not_first(quick) + quiet(quick) + fp8(quick) + buffers(quick) + tied(quick) \
        + backward(quick) + reports(quick) + intended(quick) + not_excused(quick)
