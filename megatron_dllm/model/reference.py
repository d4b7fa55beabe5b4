"""A plain-PyTorch DiT written directly from reference-algorithms.md §1 (no megatron imports).

It is the yardstick for the megatron-core `DiTModel`: the tests load a TP=1, PP=1 `DiTModel`'s
`state_dict()` into it and compare logits and gradients, and the training-step benchmark times it
against the megatron path. Batch-first ([b, s, d]) throughout, nanoGPT-style.

Vocabulary padding: megatron pads the vocabulary to a multiple of 128 * TP. By default
`from_megatron_state_dict` keeps the padded rows (embedding and output layer, so logits are
[b, s, V_padded] and line up with megatron's one for one); pass `vocab_size=` to slice both the
embedding and the output layer to the real vocabulary. The padded embedding rows are never looked
up and the losses set the padded logits to -inf, so both choices give the same loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

COND_DIM, TIME_FREQ_DIM, ROTARY_BASE, LN_EPS = 128, 256, 10000.0, 1e-5


class TimestepEmbedder(nn.Module):
    """sinusoidal(sigma) [cos, sin], 256 dims, max period 1e4 -> Linear -> SiLU -> Linear."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, COND_DIM), nn.SiLU(), nn.Linear(COND_DIM, COND_DIM))

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
        args = sigma.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class LayerNorm(nn.Module):
    """fp32 F.layer_norm without affine, then x weight (no bias), eps 1e-5."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.layer_norm(x.float(), (x.shape[-1],), eps=LN_EPS) * self.weight.float()).to(x.dtype)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int):
    """cos, sin [b, s, 1, dh] in fp32 from explicit per-token positions [b, s]."""
    inv_freq = 1.0 / ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                  device=position_ids.device) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [b, s, dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, causal: bool):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        self.norm1, self.norm2 = LayerNorm(dim), LayerNorm(dim)
        self.adaLN_modulation = nn.Linear(COND_DIM, 6 * dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x, c, cos, sin, attn_mask=None):
        b, s, d = x.shape
        (shift_msa, scale_msa, gate_msa,
         shift_mlp, scale_mlp, gate_mlp) = self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
        h = modulate(self.norm1(x), shift_msa, scale_msa)
        qkv = self.attn_qkv(h).view(b, s, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.unbind(dim=2)  # [b, s, h, dh]; V is not rotated
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if attn_mask is not None:  # explicit [b, s, s] boolean mask (True = attend) replaces the layout
            attn_mask = attn_mask[:, None]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask, is_causal=self.causal and attn_mask is None)
        x = x + gate_msa * self.attn_out(y.transpose(1, 2).reshape(b, s, d))
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.norm_final = LayerNorm(dim)
        self.adaLN_modulation = nn.Linear(COND_DIM, 2 * dim)
        self.linear = nn.Linear(dim, vocab_size)

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class ReferenceDiT(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, num_heads: int, vocab_size: int, causal: bool):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.vocab_embed = nn.Parameter(torch.empty(vocab_size, hidden_size))
        nn.init.kaiming_uniform_(self.vocab_embed, a=math.sqrt(5))
        self.sigma_map = TimestepEmbedder()
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, causal) for _ in range(num_layers))
        self.output_layer = FinalLayer(hidden_size, vocab_size)
        for m in [blk.adaLN_modulation for blk in self.blocks] + [self.output_layer.adaLN_modulation,
                                                                   self.output_layer.linear]:
            nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)  # adaLN-zero: initial logits are 0

    def forward(self, input_ids, position_ids, sigma, attn_mask=None):
        """input_ids, position_ids: [b, s]; sigma: [b]; optional attn_mask [b, s, s] bool (query i
        attends to key j iff attn_mask[:, i, j]; replaces the causal/bidirectional layout).
        Returns logits [b, s, V]."""
        x = self.vocab_embed[input_ids]
        c = F.silu(self.sigma_map(sigma))
        cos, sin = rotary_cos_sin(position_ids, self.head_dim)
        for block in self.blocks:
            x = block(x, c, cos, sin, attn_mask)
        return self.output_layer(x, c)

    @classmethod
    def from_megatron_state_dict(cls, state_dict: dict, num_heads: int, causal: bool,
                                 vocab_size: int | None = None) -> "ReferenceDiT":
        """A ReferenceDiT holding the weights of a TP=1, PP=1 `DiTModel.state_dict()`.

        Sizes are read from the state dict; `vocab_size=None` keeps megatron's padded vocabulary,
        an int slices embedding and output layer to the first `vocab_size` rows.
        """
        sd = megatron_to_reference(state_dict, num_heads, vocab_size)
        v, d = sd["vocab_embed"].shape
        layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        model = cls(d, layers, num_heads, v, causal)
        model.load_state_dict(sd)
        return model


def megatron_to_reference(state_dict: dict, num_heads: int, vocab_size: int | None = None) -> dict:
    """Renames (and reorders) a TP=1, PP=1 `DiTModel` state dict — or a dict of its gradients
    under the same names — to ReferenceDiT's names. Megatron's fused qkv rows are laid out per
    head, [h, 3, dh, d] (q_h, k_h, v_h); the reference's are [3, h, dh, d]."""
    names = {"time_embedder.mlp.": "sigma_map.mlp.", "embedding.word_embeddings.weight": "vocab_embed",
             "final_layer.norm.": "output_layer.norm_final.",  # final_layer.* before the block names
             "final_layer.adaLN_modulation.linear.": "output_layer.adaLN_modulation.",
             "final_layer.output_layer.": "output_layer.linear.", "layers.": "blocks.",
             "input_layernorm.": "norm1.", "pre_mlp_layernorm.": "norm2.",
             "adaLN_modulation.linear.": "adaLN_modulation.", "self_attention.linear_qkv.": "attn_qkv.",
             "self_attention.linear_proj.": "attn_out.", "mlp.linear_fc1.": "mlp.0.",
             "mlp.linear_fc2.": "mlp.2."}
    out = {}
    for key, value in state_dict.items():
        if "_extra_state" in key or value is None:
            continue
        new = key
        for old, rep in names.items():
            new = new.replace(old, rep)
        if new.endswith("attn_qkv.weight"):
            three_d, d = value.shape
            dh = d // num_heads
            value = value.reshape(num_heads, 3, dh, d).transpose(0, 1).reshape(three_d, d)
        if vocab_size is not None and (new == "vocab_embed" or new.startswith("output_layer.linear.")):
            value = value[:vocab_size]
        out[new] = value.detach().clone()
    return out
