"""The built-in recipes' models: small torch modules with the weights that make each failure happen.

``fixes.recipes`` registers them by ``module:function`` name, the way a
user's own recipe is named, so torch loads only when a recipe is built.
"""

from __future__ import annotations


import torch
from torch import nn

from ..formats import FORMATS
from .modules import Add, Attention, L2Normalize, LayerNorm, Linear, QuantLinear, RMSNorm, ReLU, SiLU, SwiGLU

_F16 = FORMATS["fp16"]


def _zero_rows(x, rows):
    x = x.clone()
    for b, t in rows:
        x[b, t] = 0.0
    return x


def build_fp8_zero_scale():


    class Fp8ZeroScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = Linear(32, 64)
            self.relu = ReLU()  # half the activations become exactly 0
            self.proj = QuantLinear(64, 32)

        def forward(self, x):
            return self.proj(self.relu(self.fc1(x)))

    # activations of magnitude ~0.1: amax / e5m2 max is below fp16's smallest
    # normal, and its reciprocal above fp16's max
    x = torch.randn(4, 16, 32) * 0.05
    return Fp8ZeroScale(), x


def build_calibration_nan():


    class CalibratedProjection(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Linear(16, 32, bias=False)
            self.norm = L2Normalize(32)  # x / ||x||: 0/0 on an all-zero (padding) row
            self.proj = QuantLinear(32, 32)
            self.out = Linear(32, 8)

        def forward(self, x):
            return self.out(self.proj(self.norm(self.embed(x))))

    x = torch.randn(2, 8, 16)
    x = _zero_rows(x, [(0, 6), (0, 7), (1, 7)])  # right-padded sequences
    return CalibratedProjection(), x


def build_fp8_rowwise_rmsnorm():


    class NormQuantBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(64, eps=1e-6)
            self.proj = QuantLinear(64, 64)
            self.act = SiLU()
            self.out = Linear(64, 16)

        def forward(self, x):
            return self.out(self.act(self.proj(self.norm(x))))

    x = torch.randn(2, 16, 64)
    x = _zero_rows(x, [(0, 15), (1, 14), (1, 15)])  # padding rows stay 0 through RMSNorm
    x[0, 3] = x[0, 3] * 1e-6  # a tiny row: its squares underflow fp16
    return NormQuantBlock(), x


def build_fp16_mlp_overflow():


    class DecoderLayer(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.input_layernorm = RMSNorm(dim)
            self.mlp = SwiGLU(dim, hidden)
            self.residual = Add()

        def forward(self, x):
            return self.residual(x, self.mlp(self.input_layernorm(x)))

    class TinyQwen2(nn.Module):
        def __init__(self, dim=64, hidden=128, vocab=96):
            super().__init__()
            self.layers = nn.ModuleList([DecoderLayer(dim, hidden)])
            self.norm = RMSNorm(dim)
            self.lm_head = Linear(dim, vocab, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    dim, sink_ch, mlp_ch = 64, 3, 7
    model = TinyQwen2(dim)
    mlp = model.layers[0].mlp
    with torch.no_grad():
        # bf16-trained weights with an outlier channel (the "massive
        # activation" of Qwen2/LLaMA): token 0 carries ~40 in channel 3, the
        # gate and up projections read it with weight 6 and the down
        # projection writes it back with weight 34, so that token's output
        # reaches ~78,000 — fine in bf16, beyond fp16's max
        mlp.gate_proj.weight[mlp_ch].zero_()
        mlp.up_proj.weight[mlp_ch].zero_()
        mlp.gate_proj.weight[mlp_ch, sink_ch] = 6.0
        mlp.up_proj.weight[mlp_ch, sink_ch] = 6.0
        mlp.down_proj.weight[:, mlp_ch] = 0.0
        mlp.down_proj.weight[sink_ch, mlp_ch] = 34.0
    x = torch.randn(2, 8, dim) * 0.5
    x[:, 0, sink_ch] = 40.0
    return model, x


def build_fp16_layernorm():


    class NormHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = LayerNorm(64, eps=1e-5)
            self.head = Linear(64, 16)

        def forward(self, x):
            return self.head(self.ln(x))

    x = torch.randn(1, 8, 64)
    x[0, 5] = 300.0 + 8 * torch.randn(64)  # x^2 ~ 90,000 > fp16 max: E[x^2] and E[x]^2 are inf, inf - inf = NaN
    x[0, 6] = 10.0  # zero variance: 1/sqrt(0 + eps) needs eps, which FTZ flushes
    # mean 100 with offsets on fp16's grid there (1/16): E[x^2] - E[x]^2 cancels
    # two numbers ~10,000 whose fp16 spacing (8) exceeds the true variance
    x[0, 7] = 100.0 + torch.randint(-8, 9, (64,)).float() / 16
    return NormHead(), x


def build_softmax_fp16_overflow():


    class AttentionBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(32, 2)

        def forward(self, x):
            return self.attn(x)

    model = AttentionBlock()
    with torch.no_grad():
        # sharper attention than at init (trained models have logits of tens):
        # the largest logits exceed ln(fp16 max) ~ 11.1 but stay far below
        # ln(fp32 max) ~ 88.7, so only fp16's exp() overflows
        model.attn.q_proj.weight.mul_(2.2)
        model.attn.k_proj.weight.mul_(2.2)
    x = torch.randn(2, 8, 32)
    return model, x
