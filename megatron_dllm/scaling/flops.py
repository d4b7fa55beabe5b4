"""FLOPs of the DiT (and the GPT backbone) per sequence of `seq_length` tokens, in two conventions.

Symbols: s tokens per sequence, h hidden size, L layers, V vocabulary (the real one, including
[MASK]; megatron's padding rows are not counted), c = 128 conditioning width, f = 256 sinusoid
width. A multiply-add counts 2 FLOPs. Training (forward + backward) = 3 x forward in both.

``calflops`` (the paper's convention, the default for compute budgets). The paper counts
"exact training compute" with the calflops package on its plain-PyTorch model. calflops patches
``torch.nn.functional`` (linear, layer_norm, gelu, silu, ...) and ``torch.matmul``; it does not
patch ``F.scaled_dot_product_attention`` (nor flash/flex attention kernels), so attention scores
and values are not counted. Run on the dense DiT (``hf/modeling_dllm.py``) it reports, per sequence,

    L (24 s h^2 + 12 s h + 12 c h) + 4 s h + 2 s h V + 4 c h + 2 (f c + c^2) + 2 c

linears 2 x MACs, biases not counted; adaLN 12 c h per layer, once per sequence (it acts on the
per-sequence conditioning vector); 12 s h = two layer norms (4 per element, no affine argument)
+ tanh-GELU (1 per element of the 4h MLP activation); the final layer norm 4 s h; time embedder
two linears + two SiLUs (c each); the embedding lookup, rotary, modulation, gates, residuals
(Python operators) count 0. The paper's own figures (s-sahoo/scaling-dllms configs/flops/*.json)
agree with it: multiply-adds to the 5-6 digits recorded, FLOPs within 0.2% (their model's
elementwise ops differ).
Training = 3 x forward, calflops' default backward factor 2, and the paper's step count
``int(C / (3 x forward FLOPs per sequence) / global batch)``.

``full``: every matmul of the forward pass, what ``torch.utils.flop_counter.FlopCounterMode``
reports for the same model with attention run by a dense kernel:

    L (24 s h^2 + 4 s^2 h + 12 c h) + 2 s h V + 4 c h + 2 (f c + c^2)

The difference is attention (4 s^2 h per layer: Q K^T and A V) and the few elementwise FLOPs
calflops adds. Attention adds s / (6h) to a layer's linear FLOPs: at s = 2048 ~16% for the 1.7B
model (h = 2176), ~133% for the 14M one (h = 256), so the convention changes the IsoFLOP grid.

Families: AR, MDLM, Duo and Eso-LM run the same DiT on s tokens (AR reads s + 1 tokens and feeds
s), so every count is the same for all four families. BD3-LM trains on [x_t ; x_0], 2s tokens at
positions 0..s-1 twice, through the whole model including the output layer (`model/dit.py`
computes the x_0 copy's logits too; the loss does not use them), so a sample costs the counts at 2s
(`train_flops_per_sample`; the run's `backbone_length`): linears and head twice, attention four
times in the full count, which runs the dense 2s x 2s square as SDPA with a boolean mask does.
Its block mask lets through about a quarter of that square (s^2 + s B of 4 s^2 pairs), which a
block-sparse kernel (FlexAttention on GPU) could skip; the count does not assume it.
Causal attention (AR, Eso-LM) is not halved in the full count: the local spec and
FlopCounterMode compute the full square, and one number per preset keeps the IsoFLOP grid
identical across families as in the paper. Flash/TE causal kernels skip about half the masked
blocks, so on GPU they execute up to L 2 s^2 h fewer FLOPs per sequence than the full count says.
Variable-length micro-batches (--variable-seq-length-prob) are counted at full length.

The GPT backbone (`--backbone gpt`, `gpt` = its `GPTShape`) has no time input. Per layer, with
a query heads, g key/value heads of width d and an MLP of width f:

    full:     2 s h (2 a d + 2 g d) + 4 s^2 a d + (6 with --swiglu, else 4) s h f
    calflops: the same without attention's 4 s^2 a d

plus the output layer 2 s h V (tied or not). The `full` count is FlopCounterMode's on the dense
and the megatron model (tests/test_gpt_export.py). The `calflops` count keeps the paper's rule
(linears, not attention scores) but not its elementwise terms, which were measured on the DiT
(norms and activations: under 0.1% of a layer at released models' widths).
"""
from __future__ import annotations

from megatron_dllm.errors import InputError
from megatron_dllm.model.constants import COND_DIM, TIME_FREQ_DIM
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.presets import Preset

CONVENTIONS = ("calflops", "full")


def _check(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise InputError(f"--flops-convention {convention!r} is not a known convention; expected one of: "
                         f"{', '.join(CONVENTIONS)}")


def forward_flops_per_sequence(preset: Preset, vocab_size: int, seq_length: int,
                               convention: str = "calflops", gpt: GPTShape | None = None) -> int:
    """Forward FLOPs of one sequence of `seq_length` tokens (see the module docstring); `gpt`:
    the GPT backbone's shape (None: the DiT)."""
    _check(convention)
    if gpt is not None:
        return _gpt_forward_flops(preset, gpt, vocab_size, seq_length, convention)
    h, layers, s, c, v = preset.hidden_size, preset.num_layers, seq_length, COND_DIM, vocab_size
    linears = 24 * s * h * h + 12 * c * h  # qkv, proj, MLP per token; adaLN per sequence
    time_embedder = 2 * (TIME_FREQ_DIM * c + c * c)
    head = 2 * s * h * v + 4 * c * h  # output layer + final adaLN
    if convention == "full":
        return layers * (linears + 4 * s * s * h) + head + time_embedder
    elementwise = 12 * s * h  # two layer norms + GELU per layer
    return layers * (linears + elementwise) + head + 4 * s * h + time_embedder + 2 * c


def _gpt_forward_flops(preset: Preset, gpt: GPTShape, vocab_size: int, s: int, convention: str) -> int:
    h, heads = preset.hidden_size, preset.num_attention_heads
    d = gpt.kv_channels or h // heads
    groups = gpt.num_query_groups or heads
    projections = 2 * s * h * (2 * heads * d + 2 * groups * d)  # q, k, v, output projection
    mlp = (6 if gpt.swiglu else 4) * s * h * gpt.ffn_hidden_size
    attention = 4 * s * s * heads * d if convention == "full" else 0
    return preset.num_layers * (projections + attention + mlp) + 2 * s * h * vocab_size


def train_flops_per_sequence(preset: Preset, vocab_size: int, seq_length: int,
                             convention: str = "calflops", gpt: GPTShape | None = None) -> int:
    """Forward + backward: 3 x forward (the backward pass costs twice the forward)."""
    return 3 * forward_flops_per_sequence(preset, vocab_size, seq_length, convention, gpt)


def train_flops_per_sample(preset: Preset, vocab_size: int, seq_length: int, family: str,
                           convention: str = "calflops", gpt: GPTShape | None = None) -> int:
    """Training FLOPs of one sample of `seq_length` tokens of `family` (BD3-LM: 2 x seq_length run)."""
    from megatron_dllm.families import FAMILIES

    if family not in FAMILIES:
        raise InputError(f"--family {family!r}: expected one of {', '.join(FAMILIES)}")
    return train_flops_per_sequence(preset, vocab_size, seq_length * FAMILIES[family].input_copies, convention, gpt)


def non_embedding_params(preset: Preset, vocab_size: int) -> int:
    """All parameters minus the input embedding (the paper's N), in closed form: the same number
    as model/params.py's count over the real module tree, without building megatron."""
    h, c, v = preset.hidden_size, COND_DIM, vocab_size
    layer = 12 * h * h + 6 * c * h + 13 * h  # qkv, proj, MLP weights + biases, adaLN, 2 norms
    final = h + 2 * c * h + 2 * h + h * v + v  # norm, adaLN, output layer with bias
    time_embedder = TIME_FREQ_DIM * c + c + c * c + c
    return preset.num_layers * layer + final + time_embedder
