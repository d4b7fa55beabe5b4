"""The DiT block's own elementwise regions as pure functions, eager or `torch.compile`d
(`--compile-elementwise`).

    norm_modulate    LN(x) * (1 + scale) + shift   weight-only LayerNorm in fp32, then adaLN modulation
    gated_residual   x + gate * (out + bias)        the DiT's bias-dropout-add: no dropout, an adaLN gate
    residual_norm_   both, one after the other      the attention's gated residual and the MLP's
      modulate                                      modulated norm: one region, one pass over x
    rotary           x * cos + rotate_half(x) * sin the rotary embedding of the queries and keys together

Each is compiled on its own (no graph breaks; shapes: see `regions`) rather than the whole layer:
the layer's linears are megatron-core's custom autograd Functions (tensor parallelism, gradient
accumulation), which stay outside the compiled graphs. The norm cannot join the qkv GEMM
(TransformerEngine's LayerNormLinear) because the modulation sits between them. The bias + GELU
between the MLP's GEMMs is megatron-core's own fused kernel (`--bias-gelu-fusion`). Eager, the
rotary embedding is megatron-core's own (inside its attention); compiled, `layer.DiTSelfAttention`
applies `rotary` in its place (see `model/fusion.py`).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


def norm_modulate(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """mod(LN(x)): the reference LayerNorm (no bias, fp32), back in x's dtype, then shift and scale."""
    y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    y = (y * weight.float()).to(x.dtype)
    return y * (1 + scale) + shift


def gated_residual(x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                   gate: torch.Tensor) -> torch.Tensor:
    """x + gate * (out + bias); `bias` is the second output of a megatron linear (skip_bias_add)."""
    if bias is not None:
        out = out + bias
    return x + gate * out


def residual_norm_modulate(x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                           shift: torch.Tensor, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + gate * out, mod(LN(that))): the residual stream after the attention and the MLP's input.
    Compiled as one region, it reads the new stream once instead of writing it and reading it back,
    and it costs the host one compiled call instead of two (forward and backward)."""
    x = gated_residual(x, out, None, gate)
    return x, norm_modulate(x, weight, shift, scale, eps)


def rotary(query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's rotary embedding (`_apply_rotary_pos_emb_bshd`: non-interleaved halves, no
    scaling) of the queries and the keys [s, b, n, d] at the angles freqs [s, b or 1, 1, d_rot], in
    one region (one call, one cos and sin); dimensions past d_rot pass."""
    cos, sin, rot = freqs.cos(), freqs.sin(), freqs.shape[-1]

    def rotate(x):
        x, rest = x[..., :rot], x[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        out = x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)
        return torch.cat((out, rest), dim=-1)

    return rotate(query), rotate(key)


class Regions(NamedTuple):
    norm_modulate: Callable
    gated_residual: Callable
    residual_norm_modulate: Callable
    rotary: Callable


@functools.cache
def regions(compiled: bool) -> Regions:
    """The regions eager, or compiled once per process. A graph is specialised to the shapes it
    first meets; a second size of a dimension (a variable-length micro-batch, another batch size)
    compiles it once more with that dimension dynamic (PyTorch's automatic dynamic shapes), which
    serves every later size. Specialised to every size instead, the regions would compile per
    length of `--variable-seq-length-prob`'s U[1, L] draws, and the ninth would stop the run:
    fullgraph=True turns dynamo's recompile limit (8) into an error."""
    eager = Regions(norm_modulate, gated_residual, residual_norm_modulate, rotary)
    if not compiled:
        return eager
    return Regions(*(torch.compile(fn, fullgraph=True) for fn in eager))
