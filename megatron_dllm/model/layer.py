"""The DiT block as a megatron-core module tree, assembled through layer specs.

One block (as in the paper's code): pre-norm with a weight-only LayerNorm, adaLN-zero modulation with six
chunks from the conditioning vector, megatron's SelfAttention (qkv and out projections without
bias, rotary on per-token positions) and megatron's MLP (with bias, tanh-GELU). The local spec
runs everywhere; the TransformerEngine spec swaps the linears for TE's (FP8) and keeps the same
module tree; core attention is chosen separately (`attention.py`, `--attention-backend`). The
norm cannot be fused into the qkv GEMM (TE's LayerNormLinear) because the modulation sits
between them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dllm.model.attention import core_attention_module, resolve_backend
from megatron_dllm.model.constants import COND_DIM
from megatron_dllm.model.elementwise import regions

# block_diffusion (BD3-LM): neither causal nor bidirectional; the input carries an explicit mask
ATTENTION_MASKS = {"bidirectional": AttnMaskType.no_mask, "causal": AttnMaskType.causal,
                   "block_diffusion": AttnMaskType.arbitrary}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def tag_replicated(module: torch.nn.Module, config: TransformerConfig) -> None:
    """Mark parameters that every TP rank holds whole. Under sequence parallelism each rank sees
    only its slice of the sequence, so megatron all-reduces the grads of params tagged this way."""
    for p in module.parameters():
        p.sequence_parallel = config.sequence_parallel


class DiTLayerNorm(torch.nn.Module):
    """LayerNorm without bias, computed in fp32 (reference `LayerNorm`): the weight and epsilon,
    applied together with the modulation by `elementwise.norm_modulate`."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.weight = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        tag_replicated(self, config)

    def modulated(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, compiled: bool) -> torch.Tensor:
        """mod(LN(x)) with this norm's weight."""
        return regions(compiled).norm_modulate(x, self.weight, shift, scale, self.eps)

    def after_residual(self, x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                       scale: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + gate * out, mod(LN(that))) with this norm's weight, in one region."""
        return regions(compiled).residual_norm_modulate(x, out, gate, self.weight, shift, scale, self.eps)


class OwnValuesSelfAttention(SelfAttention):
    """megatron-core's SelfAttention whose values get a storage of their own when the rotary
    embedding makes the queries and keys new tensors. megatron-core splits all three out of the
    fused QKV projection's output as views, and core attention saves the values for the backward:
    as a view they kept all of that output alive, queries and keys included. The copy costs one
    pass over the values. (Query and key norms save their inputs, views into the same output,
    which keeps it anyway: no copy then.)"""

    _new_queries_and_keys = False  # during a forward: the queries and keys will not be views

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        self._new_queries_and_keys = rotary_pos_emb is not None and not self.config.qk_layernorm
        try:
            return self._forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        finally:
            self._new_queries_and_keys = False

    def _forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)

    def get_query_key_value_tensors(self, *args, **kwargs):
        # split_qkv: megatron fuses qkv with rope only when it applies rope
        query, key, value, *rest = super().get_query_key_value_tensors(*args, **kwargs)
        if self._new_queries_and_keys:
            value = value.contiguous()
        return query, key, value, *rest


def keep_original_inputs(*linears: torch.nn.Module) -> None:
    """Under FP8, TransformerEngine's linears save an FP8 copy of their input for the backward, so
    an output-discarding checkpoint of that input would release nothing: they keep the input
    itself instead, as megatron-core's own layers do for the same recompute (its
    `set_save_original_input`; TE >= 2.6, and not with delayed scaling, which config/validate.py
    refuses)."""
    from megatron.core.extensions.transformer_engine import set_save_original_input

    for linear in linears:
        set_save_original_input(linear)


class ActivationRecomputingMLP(MLP):
    """megatron-core's MLP that, with `--recompute-modules mlp_act` (training), releases the
    activation's output once the second linear has saved it and recomputes it from the first
    linear's output when the backward reaches the second linear: megatron-core's output-discarding
    checkpoint, as Megatron-LM's `moe_act` does for MoE experts. The first linear's output is kept
    (the activation's backward needs it anyway); what goes is the activation's output, an
    --ffn-hidden-size vector a token (4h in the DiT), for one more elementwise pass. The flag
    reaches here as the config's `recompute_mlp_activation` (megatron-core's config knows no such
    module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._keep_second_linear_s_input()

    @classmethod
    def adopt(cls, mlp: MLP) -> None:
        """Make megatron-core's MLP `mlp`, built by another module, one of these (it adds methods only)."""
        mlp.__class__ = cls
        mlp._keep_second_linear_s_input()

    @property
    def recomputes_activation(self) -> bool:
        return getattr(self.config, "recompute_mlp_activation", False)

    def _keep_second_linear_s_input(self) -> None:
        if self.config.fp8 and self.recomputes_activation:
            keep_original_inputs(self.linear_fc2)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not (self.training and self.recomputes_activation):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        assert per_token_scale is None, "an MoE expert's per-token scale: not an MLP built here"
        fc1_out, fc1_bias = self.linear_fc1(hidden_states)
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)  # None: no FP8 state
        out, out_bias = self.linear_fc2(checkpoint.checkpoint(self.activation, fc1_out, fc1_bias))
        checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def activation(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """megatron-core's `MLP.forward` between its linears, for the MLPs built here: the DiT's
        (tanh-)GELU and the GPT backbone's GELU or SwiGLU, fused (`--bias-gelu-fusion`,
        `--bias-swiglu-fusion`) or not."""
        c = self.config
        if c.bias_activation_fusion:
            if c.gated_linear_unit:
                return bias_swiglu_impl(x, bias, c.activation_func_fp8_input_store, False)
            return bias_gelu_impl(x, bias)
        if bias is not None:
            x = x + bias
        if not c.gated_linear_unit:
            return self.activation_func(x)
        gate, linear = torch.chunk(x, 2, dim=-1)
        return self.activation_func(gate) * linear


class DiTSelfAttention(OwnValuesSelfAttention):
    """With `--compile-elementwise` the rotary embedding runs as one compiled region on the new
    queries and keys (`elementwise.rotary`) instead of megatron-core's unfused one (cos, sin, a
    rotate-half and two products per tensor, forward and backward, each a kernel of its own).
    TransformerEngine's fused RoPE cannot stand in: it takes one position table for the whole
    batch, and the DiT's positions are per sample."""

    _freqs = None  # the rotary angles of the forward in progress (compiled path)

    def _forward(self, *args, rotary_pos_emb=None, **kwargs):
        if not getattr(self.config, "compile_elementwise", False) or rotary_pos_emb is None:
            return super()._forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        self._freqs = rotary_pos_emb
        try:
            return super()._forward(*args, **kwargs)  # megatron's rotary is skipped
        finally:
            self._freqs = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        query, key, *rest = super().get_query_key_value_tensors(*args, **kwargs)
        if self._freqs is None:
            return query, key, *rest
        return (*regions(True).rotary(query, key, self._freqs), *rest)


class AdaLNModulation(torch.nn.Module):
    """Linear(cond_dim, chunks * hidden) over the conditioning vector, zero-initialised so every
    block starts as the identity. Replicated over TP: it acts once per sequence, not per token."""

    def __init__(self, config: TransformerConfig, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = torch.nn.Linear(COND_DIM, chunks * config.hidden_size, dtype=config.params_dtype)
        tag_replicated(self, config)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # c: [b, cond_dim] -> chunks of [1, b, h], broadcast over the sequence dimension.
        return self.linear(c).unsqueeze(0).chunk(self.chunks, dim=-1)


@dataclass
class DiTLayerSubmodules:
    self_attention: ModuleSpec
    mlp: ModuleSpec


class DiTLayer(MegatronModule):
    """x -> x + gate_msa * Attn(mod(LN(x))) -> x + gate_mlp * MLP(mod(LN(x))); x is [s, b, h]."""

    def __init__(self, config: TransformerConfig, submodules: DiTLayerSubmodules, layer_number: int,
                 mlp_config: TransformerConfig):
        super().__init__(config=config)
        self.layer_number = layer_number  # global, 1-based, as in megatron's TransformerLayer
        self.input_layernorm = DiTLayerNorm(config)
        self.adaLN_modulation = AdaLNModulation(config, chunks=6)
        self.self_attention = build_module(submodules.self_attention, config=config,
                                           layer_number=layer_number)
        self.pre_mlp_layernorm = DiTLayerNorm(config)
        self.mlp = build_module(submodules.mlp, config=mlp_config,
                                ffn_hidden_size=mlp_config.ffn_hidden_size)
        self.compiled = getattr(config, "compile_elementwise", False)  # set by builder.transformer_config
        # selective recompute beyond core attention (which megatron's SelfAttention does itself)
        modules = config.recompute_modules if config.recompute_granularity == "selective" else []
        self.recompute_norms, self.recompute_mlp = "layernorm" in modules, "mlp" in modules
        if config.fp8 and self.recompute_norms:  # the norms' outputs go to these two
            keep_original_inputs(self.self_attention.linear_qkv, self.mlp.linear_fc1)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rotary_pos_emb: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attention_mask: None (the spec's layout) or bool [1 or b, 1, s, s], True = masked out."""
        norms, mlp = self.training and self.recompute_norms, self.training and self.recompute_mlp
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c)
        h, release = self._modulated(self.input_layernorm, x, shift_msa, scale_msa, norms)
        attn_out, _ = self.self_attention(h, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        release(attn_out)
        if norms:  # the norm on its own, so that it alone is recomputed
            x = regions(self.compiled).gated_residual(x, attn_out, None, gate_msa)
            h, release = self._modulated(self.pre_mlp_layernorm, x, shift_mlp, scale_mlp, norms)
        else:
            x, h = self.pre_mlp_layernorm.after_residual(x, attn_out, gate_msa, shift_mlp, scale_mlp, self.compiled)
        if mlp:  # a checkpoint cannot return fc2's bias parameter: added inside
            mlp_out, mlp_bias = tensor_parallel.checkpoint(self._mlp_with_bias, False, h), None
        else:
            mlp_out, mlp_bias = self.mlp(h)  # megatron's fc2 returns its bias separately (skip_bias_add)
        release(mlp_out)
        if not self.config.bias_dropout_fusion and mlp_bias is not None:  # the bias added on its own
            mlp_out, mlp_bias = mlp_out + mlp_bias, None
        return regions(self.compiled).gated_residual(x, mlp_out, mlp_bias, gate_mlp)

    def _mlp_with_bias(self, h: torch.Tensor) -> torch.Tensor:
        out, bias = self.mlp(h)
        return out if bias is None else out + bias

    def _modulated(self, norm: DiTLayerNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                   recompute: bool):
        """(mod(norm(x)), release). With `recompute` (`--recompute-modules layernorm`, training) the
        output comes from megatron-core's output-discarding checkpoint: `release(t)`, called with the
        tensor whose gradient the backward computes first after the output's last use, frees the
        output's storage (the next linear saved it) and refills it from the norm's input when that
        gradient is reached."""
        if not recompute:
            return norm.modulated(x, shift, scale, self.compiled), _keep
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)  # None: no FP8 state
        h = checkpoint.checkpoint(partial(norm.modulated, compiled=self.compiled), x, shift, scale)
        return h, checkpoint.discard_output_and_register_recompute


def _keep(hook_tensor: torch.Tensor) -> None:
    """`DiTLayer._modulated`'s release without recompute: the output stays."""


def dit_layer_spec(attention: str, use_te: bool = False, attention_backend: str | None = None) -> ModuleSpec:
    """The block's spec for an attention layout (`bidirectional`, `causal` or `block_diffusion`) and
    a core-attention backend (`model.attention`; default: TE's with TE linears, else megatron-core's local one)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        column, row = TEColumnParallelLinear, TERowParallelLinear
    else:
        column, row = ColumnParallelLinear, RowParallelLinear
    core_attention = core_attention_module(resolve_backend(attention_backend, use_te))
    return ModuleSpec(
        module=DiTLayer,
        submodules=DiTLayerSubmodules(
            self_attention=ModuleSpec(
                module=DiTSelfAttention,
                params={"attn_mask_type": ATTENTION_MASKS[attention]},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column, core_attention=core_attention, linear_proj=row,
                    q_layernorm=IdentityOp, k_layernorm=IdentityOp,
                ),
            ),
            mlp=ModuleSpec(module=ActivationRecomputingMLP,
                           submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
        ),
    )
