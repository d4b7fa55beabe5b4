"""The megatron_dllm DiT as a transformers model (self-contained: torch + transformers only).

`DiT` is the one dense implementation of the backbone: every HF export runs it, sampling and
evaluation load megatron checkpoints into it, and the tests and the training-step benchmark hold
the megatron model against it. The fixed sizes and constants come from the config. `GPT` is the
same for the GPT (Llama-style) backbone (`--backbone gpt`), chosen when the config has a `gpt`
shape: a diffusion model adapted from a Llama or Qwen2 exports as this file with that backbone.

Pre-norm DiT blocks with adaLN-zero time conditioning c = SiLU(MLP(sinusoidal(sigma))), rotary
over the full head dimension from explicit per-token positions, SDPA attention (no bias on qkv
and out projections), tanh-GELU MLP with bias, final LN + adaLN + Linear(h, V) with bias.

forward(input_ids, position_ids=None, sigma=None, timesteps=None, attention_mask=None, kv_cache=None,
kv_keep=None) -> logits [b, s, V]. `sigma` is the per-sequence time input ([b] or a scalar); for Duo
it is -log alpha_t.
`timesteps` t in [0, 1] is converted with the log-linear schedule, sigma = -log(1 - (1 - eps) t).
AR, MDLM and Eso-LM were trained with sigma = 0 (the default). Eso-LM takes the sequence in its
shuffled order with `position_ids` = the original positions, and attends causally over that order.
Causal models decode incrementally with `kv_cache=KVCache(num_layers, max_length)` (see `KVCache`).
DLLMForMaskedLM.generate (alias diffusion_generate) samples with megatron_dllm's own samplers,
which an export ships beside this file (megatron_dllm/sampling/hf_generation.py); the AR family's
DLLMForCausalLM keeps transformers' generate.
"""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput, MaskedLMOutput

try:
    from .configuration_dllm import DLLMConfig
except ImportError:  # loaded as a top-level module
    from configuration_dllm import DLLMConfig


class TimestepEmbedder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.freq_dim, self.max_period = config.time_freq_dim, config.time_max_period
        self.mlp = nn.Sequential(nn.Linear(config.time_freq_dim, config.cond_dim), nn.SiLU(),
                                 nn.Linear(config.cond_dim, config.cond_dim))

    def forward(self, sigma):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32,
                                                                   device=sigma.device) / half)
        args = sigma.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class LayerNorm(nn.Module):
    """fp32 layer norm without bias (weight only)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()).to(x.dtype)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotary_inv_freq(head_dim, base, device=None):
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def llama3_scaled(inv_freq, factor, low_freq_factor=1.0, high_freq_factor=4.0, original_length=8192):
    """Llama-3's rope scaling of the frequencies (Meta's formula; megatron-core's fixed factors):
    long wavelengths divided by `factor`, short ones kept, those between interpolated."""
    wavelen = 2 * math.pi / inv_freq
    low, high = original_length / low_freq_factor, original_length / high_freq_factor
    scaled = torch.where(wavelen > low, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high) & (wavelen <= low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(position_ids, head_dim, base, inv_freq=None):
    if inv_freq is None:
        inv_freq = rotary_inv_freq(head_dim, base, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class KVCache:
    """Keys and values of the tokens already processed, per layer ([b, heads, n, head_dim]).

    A causal forward with `kv_cache` runs only the new tokens: their queries see every cached key
    and, causally, the new slice (rotary at the given positions). Afterwards the first `kv_keep`
    new tokens (default: all) count as cached. Eso-LM's sampler keeps only the tokens that are
    clean now, not the masks it is decoding, so every token's K/V is computed once, as a clean token.

    Static (`max_length` given; what the samplers use): each layer's buffers are allocated once,
    [b, heads, max_length, head_dim], the new K/V are written in place at the current length and
    attention reads the filled prefix (a view), so no step copies the cache; the entries past
    `kv_keep` are overwritten by the next call. Growing (`max_length=None`): each call concatenates,
    for callers that do not know the final length.

    Fixed-shape (`fixed_shape=True`, with `max_length`): the cached count lives on the device
    (`filled`), new K/V are written at it with `index_copy_` and attention reads the whole buffers
    under a mask of the written keys, so a forward's shapes, addresses and host code are the same
    at every step: a CUDA graph captured once replays at any length (sampling/cuda_graphs.py).
    `kv_keep` may then be a device tensor too. `filled` is made here, on `device` (the model's),
    not by the first forward: made inside a compiled one, it would be 0 + kv_keep, which
    TorchInductor folds to kv_keep itself, so the cache would then advance the caller's kv_keep
    tensor in place (a CUDA graph's, reused by later steps and samples) and write past max_length.
    """

    def __init__(self, num_layers, max_length=None, fixed_shape=False, device=None):
        if fixed_shape and max_length is None:
            raise ValueError("KVCache: fixed_shape needs max_length")
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.max_length = max_length
        self.fixed_shape = fixed_shape
        self.length = 0  # cached tokens (fixed_shape: `filled` holds them)
        # fixed_shape: the cached count, a long scalar on the model's device
        self.filled = torch.zeros((), dtype=torch.long, device=device) if fixed_shape else None

    def __len__(self):
        return int(self.filled) if self.filled is not None else self.length

    def offset(self, device):
        """The position of the first new token: the cached count (a device tensor when fixed-shape)."""
        if not self.fixed_shape:
            return self.length
        if self.filled.device != device:
            raise ValueError(f"KVCache: a fixed-shape cache made on {self.filled.device} (device=) is used on {device}")
        return self.filled

    def extend(self, layer, k, v):
        """Cached + new keys/values for attention: [b, heads, length + s, head_dim] (fixed-shape:
        the whole buffers, [b, heads, max_length, head_dim])."""
        if self.fixed_shape:
            if self.keys[layer] is None:
                shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
                self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
            slots = self.offset(k.device) + torch.arange(k.shape[2], device=k.device)
            self.keys[layer].index_copy_(2, slots, k)
            self.values[layer].index_copy_(2, slots, v)
            return self.keys[layer], self.values[layer]
        n, end = self.length, self.length + k.shape[2]
        if self.max_length is None:
            if self.keys[layer] is not None:
                k = torch.cat([self.keys[layer][:, :, :n], k], dim=2)
                v = torch.cat([self.values[layer][:, :, :n], v], dim=2)
            self.keys[layer], self.values[layer] = k, v
            return k, v
        if end > self.max_length:
            raise ValueError(f"KVCache: {end} tokens exceed max_length {self.max_length}")
        if self.keys[layer] is None:
            shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
        self.keys[layer][:, :, n:end] = k
        self.values[layer][:, :, n:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, keep):
        """After a forward: its first `keep` new tokens are now cached."""
        if self.fixed_shape:
            self.filled += keep  # in place: a captured graph replays it
        else:
            self.length += keep

    def rows(self, index):
        """A copy holding only the batch rows `index` (rows that leave a batch, or a call on some rows)."""
        out = KVCache(len(self.keys), self.max_length, self.fixed_shape, getattr(self.filled, "device", None))
        out.keys = [None if k is None else k[index] for k in self.keys]
        out.values = [None if v is None else v[index] for v in self.values]
        out.length = self.length
        out.filled = None if self.filled is None else self.filled.clone()
        return out


class DiTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.n_heads = config.num_heads
        self.norm1 = LayerNorm(d, config.layer_norm_eps)
        self.norm2 = LayerNorm(d, config.layer_norm_eps)
        self.adaLN_modulation = nn.Linear(config.cond_dim, 6 * d)
        self.attn_qkv = nn.Linear(d, 3 * d, bias=False)  # rows [3, heads, head_dim]
        self.attn_out = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x, c, cos, sin, attn_mask, causal, kv_cache=None, layer=0):
        b, s, d = x.shape
        (shift_msa, scale_msa, gate_msa,
         shift_mlp, scale_mlp, gate_mlp) = self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
        h = modulate(self.norm1(x), shift_msa, scale_msa)
        q, k, v = self.attn_qkv(h).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(dim=2)
        q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.extend(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and attn_mask is None)
        x = x + gate_msa * self.attn_out(y.transpose(1, 2).reshape(b, s, d))
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.norm_final = LayerNorm(d, config.layer_norm_eps)
        self.adaLN_modulation = nn.Linear(config.cond_dim, 2 * d)
        self.linear = nn.Linear(d, config.vocab_size)

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_heads
        self.vocab_embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.sigma_map = TimestepEmbedder(config)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.num_layers))
        self.output_layer = FinalLayer(config)

    def forward(self, input_ids, position_ids, sigma, attn_mask=None, kv_cache=None, kv_keep=None, logits_at=None):
        """input_ids, position_ids: [b, s]; sigma: [b]; attn_mask: None (the config's attention
        layout) or a boolean [b, 1, s, s] mask (True = attend) that replaces it (with `kv_cache`:
        over the keys its `extend` returns, [b, 1, s, n + s] for cached + new keys: batched
        decoding with padding, or a bidirectional cache's own layout). Logits [b, s, V], or only
        at `logits_at` (the output layer runs only there): [n, V] at flat positions [n] of [b, s],
        [b, n, V] at a slice of the positions of every row."""
        x = self.vocab_embed(input_ids)
        c = F.silu(self.sigma_map(sigma))
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.config.rope_theta)
        attn_mask, causal = attention_layout(self.config, input_ids, attn_mask, kv_cache)
        for i, block in enumerate(self.blocks):
            x = block(x, c, cos, sin, attn_mask, causal, kv_cache, i)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1] if kv_keep is None else kv_keep)
        if isinstance(logits_at, slice):
            return self.output_layer(x[:, logits_at], c)
        if logits_at is not None:
            return self.output_layer(x.flatten(0, 1)[logits_at, None], c[logits_at // x.shape[1]])[:, 0]
        return self.output_layer(x, c)


def attention_layout(config, input_ids, attn_mask, kv_cache):
    """(the boolean mask SDPA gets or None, is_causal) for a forward of `input_ids` over the
    cached and new keys: an explicit mask as given, else the config's attention layout."""
    if kv_cache is not None and attn_mask is None and config.attention not in ("causal", "block_diffusion"):
        raise ValueError("kv_cache on a bidirectional model needs an explicit attention mask")
    if attn_mask is None and (kv_cache is not None or config.attention == "block_diffusion"):
        device = input_ids.device
        n = 0 if kv_cache is None else kv_cache.offset(device)
        keys = kv_cache.max_length if kv_cache is not None and kv_cache.fixed_shape else None
        attn_mask = layout_mask(config, n, input_ids.shape[1], device, keys)
    return attn_mask, config.attention == "causal"


def layout_mask(config, n, s, device, keys=None):
    """[s, keys] bool (True = attend): the queries of the new tokens at positions n..n+s-1 over
    the cached and new keys (`keys`: the key slots, default n + s; a fixed-shape cache's n is a
    device tensor and its slots past n + s are unwritten). causal: keys up to the query;
    block_diffusion (BD3-LM over a clean sequence): keys in the query's block or an earlier one,
    block_size from family_options."""
    q = n + torch.arange(s, device=device)[:, None]
    k = torch.arange(n + s if keys is None else keys, device=device)[None, :]
    written = k < n + s
    if config.attention == "block_diffusion":
        block = config.family_options["block_size"]
        q, k = q // block, k // block
    return (k <= q) & written


class RMSNorm(LayerNorm):
    """Llama's RMS norm, computed in fp32 (weight only)."""

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class GPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        gpt, h = config.gpt, config.hidden_size
        self.heads = config.num_heads
        self.groups = gpt["num_query_groups"] or self.heads
        self.head_dim = gpt["kv_channels"] or h // self.heads
        bias = gpt["add_qkv_bias"]
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.groups * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.groups * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, attn_mask, causal, kv_cache, layer):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
        if kv_cache is not None:  # cached per key/value head, expanded per query head below
            k, v = kv_cache.extend(layer, k, v)
        repeat = self.heads // self.groups  # query heads g*repeat .. (g+1)*repeat-1 read key/value head g
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and attn_mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class GPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, ffn = config.hidden_size, config.gpt["ffn_hidden_size"]
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        eps = config.gpt["norm_epsilon"]
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = GPTAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GPTMLP(config)

    def forward(self, x, cos, sin, attn_mask, causal, kv_cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, causal, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    """The GPT (Llama-style) backbone, `config.gpt` set (its shape, megatron_dllm's GPTShape fields):
    RMSNorm, SwiGLU, grouped-query attention with optional q/k/v biases (Qwen2), rotary with
    Llama-3 scaling, tied or untied output layer; no time input (sigma is ignored). Parameter
    names are transformers' LlamaModel's (with `lm_head` when untied), so its weights are a
    Llama's under another prefix. Same calling convention, attention layouts and KV cache as DiT."""

    def __init__(self, config):
        super().__init__()
        gpt = config.gpt
        self.config = config
        self.head_dim = gpt["kv_channels"] or config.hidden_size // config.num_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, gpt["norm_epsilon"])
        untied = gpt["untie_embeddings_and_output_weights"]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if untied else None

    def forward(self, input_ids, position_ids, sigma=None, attn_mask=None, kv_cache=None, kv_keep=None,
                logits_at=None):
        """As DiT.forward; sigma is ignored. Logits [b, s, V] (or only at `logits_at`)."""
        x = self.embed_tokens(input_ids)
        # the frequencies are computed here, not kept as a buffer: transformers' loading leaves
        # non-persistent buffers uninitialised
        gpt = self.config.gpt
        inv_freq = rotary_inv_freq(self.head_dim, gpt["rotary_base"], input_ids.device)
        if gpt["rope_scaling_factor"] is not None:
            inv_freq = llama3_scaled(inv_freq, gpt["rope_scaling_factor"])
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, None, inv_freq)
        attn_mask, causal = attention_layout(self.config, input_ids, attn_mask, kv_cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, causal, kv_cache, i)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1] if kv_keep is None else kv_keep)
        if isinstance(logits_at, slice):
            x = x[:, logits_at]
        elif logits_at is not None:
            x = x.flatten(0, 1)[logits_at]
        x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed_tokens.weight)


def _diffusion_generate():
    """The sampling code behind DLLMForMaskedLM.generate: in an export, the sampler files shipped
    beside this one; when this file is megatron_dllm's own (megatron_dllm/hf/), megatron_dllm/sampling."""
    try:
        from .hf_generation import diffusion_generate
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.hf_generation":
            raise
        from megatron_dllm.sampling.hf_generation import diffusion_generate
    return diffusion_generate


class DLLMPreTrainedModel(PreTrainedModel):
    config_class = DLLMConfig
    base_model_prefix = "backbone"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _no_split_modules = ["DiTBlock", "GPTBlock"]

    def __init__(self, config):
        super().__init__(config)
        self.backbone = GPT(config) if getattr(config, "gpt", None) else DiT(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embed_tokens if isinstance(self.backbone, GPT) else self.backbone.vocab_embed

    def set_input_embeddings(self, value):
        setattr(self.backbone, "embed_tokens" if isinstance(self.backbone, GPT) else "vocab_embed", value)

    def get_output_embeddings(self):  # None: a GPT whose output layer is its (tied) embedding
        return self.backbone.lm_head if isinstance(self.backbone, GPT) else self.backbone.output_layer.linear

    def set_output_embeddings(self, value):  # resize_token_embeddings resizes both
        if isinstance(self.backbone, GPT):
            self.backbone.lm_head = value
        else:
            self.backbone.output_layer.linear = value

    def _init_weights(self, module):
        """The training initialisation: nn.Linear defaults, U(+-1/sqrt(h)) embedding, adaLN-zero and
        a zero output layer (initial logits are 0)."""
        if isinstance(module, nn.Embedding):
            bound = 1.0 / math.sqrt(module.weight.shape[1])
            nn.init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, LayerNorm):  # RMSNorm too
            nn.init.ones_(module.weight)
        if isinstance(module, (DiTBlock, FinalLayer)):
            for m in [module.adaLN_modulation] + ([module.linear] if isinstance(module, FinalLayer) else []):
                nn.init.zeros_(m.weight)
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ inputs

    def _sigma(self, input_ids, sigma, timesteps):
        b = input_ids.shape[0]
        if sigma is None and timesteps is not None:
            t = torch.as_tensor(timesteps, dtype=torch.float32, device=input_ids.device)
            if self.config.noise_schedule != "loglinear":
                raise ValueError(f"unknown noise schedule {self.config.noise_schedule!r}")
            sigma = -torch.log1p(-(1 - self.config.noise_eps) * t)
        if sigma is None:
            return torch.zeros(b, dtype=torch.float32, device=input_ids.device)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=input_ids.device)
        return sigma.reshape(-1).expand(b) if sigma.numel() == 1 else sigma.reshape(b)

    def _attn_mask(self, input_ids, attention_mask, position_ids):
        """None (the family's layout) or a [b, 1, s, s] boolean mask from a [b, s] key padding
        mask (1 = attend) or an explicit [b, s, s] or [b or 1, 1, s, s] mask, combined with the
        family's layout (causal, or BD3-LM's block-causal over `position_ids`' blocks)."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 4:  # explicit, as SDPA takes it (BD3-LM's [x_t ; x_0] mask)
            return attention_mask.to(device=input_ids.device).bool()
        s = input_ids.shape[1]
        mask = attention_mask.to(device=input_ids.device).bool()
        if mask.dim() == 2:
            if bool(mask.all()):
                return None
            mask = mask[:, None, :].expand(-1, s, -1)
            if self.config.attention == "block_diffusion":  # by position: a left-padded row's from its first token
                blocks = position_ids.div(self.config.family_options["block_size"], rounding_mode="floor")
                mask = mask & (blocks[:, None, :] <= blocks[:, :, None])
            elif self.config.attention == "causal":
                mask = mask & layout_mask(self.config, 0, s, mask.device)
            mask = mask | torch.eye(s, dtype=torch.bool, device=mask.device)  # no empty rows
        return mask[:, None]

    def _logits(self, input_ids, position_ids, sigma, timesteps, attention_mask, kv_cache=None, kv_keep=None,
                logits_at=None, **unsupported):
        if unsupported.get("output_hidden_states") or unsupported.get("output_attentions"):
            raise ValueError("output_hidden_states / output_attentions: this model returns logits only")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [batch, length], got shape {tuple(input_ids.shape)}")
        if position_ids is None and kv_cache is None:
            if input_ids.shape[1] > self.config.max_position_embeddings:
                raise ValueError(f"input_ids: {input_ids.shape[1]} tokens exceed the model's context of "
                                 f"{self.config.max_position_embeddings} (max_position_embeddings)")
            if attention_mask is not None and attention_mask.dim() == 2:  # left padding: each row from 0
                position_ids = (attention_mask.to(input_ids.device).long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:  # after the cached tokens when decoding incrementally
            start = 0 if kv_cache is None else kv_cache.offset(input_ids.device)
            position_ids = start + torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids[None].expand_as(input_ids)
        return self.backbone(input_ids, position_ids, self._sigma(input_ids, sigma, timesteps),
                             self._attn_mask(input_ids, attention_mask, position_ids), kv_cache, kv_keep, logits_at)


class DLLMForMaskedLM(DLLMPreTrainedModel):
    """Diffusion families (mdlm, duo, esolm, bd3lm): logits for every position, and `generate` with the
    family's own sampler (megatron_dllm's sampling code, which every export ships beside this file)."""

    def generate(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs) -> torch.LongTensor:
        """Samples [rows, prompt + max_new_tokens]: `generate(input_ids, max_new_tokens=, steps=,
        sampler="ancestral", seed=0 | generator=, temperature=, top_p=, num_return_sequences=, ...)`,
        exactly megatron_dllm's samples for the same seed (hf_generation.py documents the arguments)."""
        return _diffusion_generate()(self, input_ids, attention_mask, **kwargs)

    diffusion_generate = generate  # Dream's name


    def forward(self, input_ids: torch.LongTensor, position_ids: Optional[torch.LongTensor] = None,
                sigma: Optional[torch.Tensor] = None, timesteps: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                return_dict: Optional[bool] = None, kv_cache: Optional[KVCache] = None,
                kv_keep: Optional[int] = None, logits_at: Optional[torch.LongTensor] = None, **kwargs):
        """`logits_at`: flat positions [n] of the [batch, length] input (logits [n, V]) or a slice of
        the positions of every row (logits [batch, n, V]); the output layer runs only there (a
        sampler that needs a few positions' logits)."""
        if logits_at is not None and labels is not None:
            raise ValueError("labels score every position; logits_at keeps only some")
        logits = self._logits(input_ids, position_ids, sigma, timesteps, attention_mask, kv_cache, kv_keep,
                              logits_at, **kwargs)
        loss = None
        if labels is not None:  # plain CE over positions with label != -100
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return MaskedLMOutput(loss=loss, logits=logits)


class DLLMForCausalLM(DLLMPreTrainedModel, GenerationMixin):
    """The AR family: causal attention, sigma = 0. transformers' generate() recomputes the prefix at
    each step; megatron_dllm's sampler decodes incrementally with `kv_cache`."""


    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        # what forward refuses reaches it (generate would otherwise return hidden states of None)
        refused = {k: kwargs[k] for k in ("output_hidden_states", "output_attentions") if kwargs.get(k)}
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep,
                **refused}

    def forward(self, input_ids: torch.LongTensor, position_ids: Optional[torch.LongTensor] = None,
                sigma: Optional[torch.Tensor] = None, timesteps: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                return_dict: Optional[bool] = None, logits_to_keep: int = 0,
                kv_cache: Optional[KVCache] = None, kv_keep: Optional[int] = None,
                logits_at: Optional[torch.LongTensor] = None, **kwargs):
        """`logits_to_keep` k > 0 (transformers' generate passes 1): logits [b, k, V] of the last k
        positions, the output layer run only there unless `labels` need every position.
        `logits_at`: as DLLMForMaskedLM's."""
        if logits_at is not None and (labels is not None or logits_to_keep):
            raise ValueError("logits_at keeps only some positions; labels and logits_to_keep need others")
        if logits_to_keep and labels is None:
            logits_at = slice(-logits_to_keep, None)
        logits = self._logits(input_ids, position_ids, sigma, timesteps, attention_mask, kv_cache, kv_keep,
                              logits_at, **kwargs)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        if logits_to_keep and labels is not None:
            logits = logits[:, -logits_to_keep:]
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutput(loss=loss, logits=logits)
