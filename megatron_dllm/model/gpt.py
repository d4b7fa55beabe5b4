"""The Llama-style backbone (`--backbone gpt`): megatron-core's own GPTModel, built from its GPT
layer spec and shaped by Megatron-LM's GPT flags, as the DiT's alternative for starting from a
pretrained autoregressive model (Llama, Mistral, Qwen2, SmolLM2).

    x      = VocabParallelEmbedding(ids) (+ learned positions)     [s, b, h]  (first stage)
    x      = TransformerLayer(x, rotary(position_ids)) x layers    (megatron-core's GPT layer)
    logits = output_layer(norm(x)), tied to the embedding unless untied  [s, b, V/tp] (last stage)

Same contract as the DiT (`dit.DiTModel`): token ids, per-token position ids and a per-sequence
sigma in, vocab-parallel logits out. The differences:
- **No time conditioning.** sigma is accepted and ignored: AR and MDLM need none (MDLM's
  denoiser reads the noise level from the number of [MASK] tokens), Duo trains time-agnostic (a
  uniform-state denoiser infers the noise level from its input, so the family code is unchanged)
  and Eso-LM passes sigma = 0 anyway. A pretrained AR model has no time input to reuse.
- **Rotary from explicit per-token positions**, as the DiT: megatron-core's RotaryEmbedding gives
  the frequencies (its `--rotary-base`, `--rotary-percent`, Llama-3 `rope_scaling`) and the angles
  are taken at each sample's own position ids, so Eso-LM's permuted order keeps every token's
  position. (GPTModel's own forward rotates by sequence index only.)
- Norms are torch's LayerNorm/RMSNorm tagged for sequence parallelism (megatron-core's local
  spec uses the same torch modules but refuses sequence parallelism without Apex).
- The attention's values get a storage of their own (`layer.OwnValuesSelfAttention`), and the
  MLP can recompute its activation (`layer.ActivationRecomputingMLP`), as the DiT's.
"""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dllm.model.attention import core_attention_module, resolve_backend
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.layer import ATTENTION_MASKS, ActivationRecomputingMLP, OwnValuesSelfAttention


class TorchNorm:
    """torch's LayerNorm or RMSNorm (`config.normalization`) with its parameters tagged
    `sequence_parallel`, so megatron all-reduces their gradients over TP under sequence parallelism
    (megatron-core's WrappedTorchNorm refuses sequence parallelism)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def gpt_layer_spec(shape: GPTShape, attention: str, use_te: bool = False,
                   attention_backend: str | None = None) -> ModuleSpec:
    """megatron-core's GPT layer spec (local, or TransformerEngine's with the norms fused into the
    following linears), with this run's attention layout and core-attention backend."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization=shape.normalization)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchNorm
        if shape.qk_layernorm:
            spec.submodules.self_attention.submodules.q_layernorm = TorchNorm
            spec.submodules.self_attention.submodules.k_layernorm = TorchNorm
    attn = spec.submodules.self_attention
    attn.module = OwnValuesSelfAttention
    attn.params = {**attn.params, "attn_mask_type": ATTENTION_MASKS[attention]}
    attn.submodules.core_attention = core_attention_module(resolve_backend(attention_backend, use_te))
    return spec


class GPTBackbone(GPTModel):
    """One pipeline chunk of megatron-core's GPTModel, called as the DiT is."""

    def __init__(self, config: TransformerConfig, shape: GPTShape, layer_spec: ModuleSpec, padded_vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, use_te: bool = False):
        if use_te:
            from megatron.core.extensions.transformer_engine import TENorm as final_norm
        else:
            final_norm = TorchNorm
        layers = get_num_layers_to_build(config, vp_stage=vp_stage)
        block = TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=final_norm)
        super().__init__(
            config, block, padded_vocab_size, max_sequence_length, pre_process=pre_process,
            post_process=post_process, parallel_output=True,
            share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
            position_embedding_type=shape.position_embedding_type, rotary_percent=shape.rotary_percent,
            rotary_base=shape.rotary_base, rope_scaling=shape.rope_scaling_factor is not None,
            rope_scaling_factor=shape.rope_scaling_factor or 8.0, vp_stage=vp_stage,
        )
        # megatron-core's TransformerLayer hands its TP group only to a spec whose module is MLP itself
        # (any other is built with a warning): its MLPs become the subclass, which adds methods only
        for layer in self.decoder.layers:
            if type(layer.mlp) is MLP:
                ActivationRecomputingMLP.adopt(layer.mlp)
        self.shape = shape
        self.layer_offset = get_transformer_layer_offset(config, vp_stage)  # read by model.init
        self.padded_vocab_size = padded_vocab_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                sigma: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids: [b, s]; sigma is ignored (no time conditioning); attention_mask as
        the DiT's (None: the layer spec's layout). Returns logits [s, b, V/tp] on the last stage,
        hidden states [s, b, h] elsewhere."""
        del sigma
        x = self.embedding(input_ids=input_ids, position_ids=position_ids) if self.pre_process else None
        rotary = self.rotary_freqs(position_ids) if self.position_embedding_type == "rope" else None
        x = self.decoder(hidden_states=x, attention_mask=attention_mask, rotary_pos_emb=rotary)
        if not self.post_process:
            return x
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(x, weight=weight)
        return logits

    def rotary_freqs(self, position_ids: torch.Tensor) -> torch.Tensor:
        """megatron-core's rotary frequencies at explicit per-token positions: [b, s] -> [s, b, 1, d_rot]
        (non-interleaved halves, as RotaryEmbedding.forward lays them out)."""
        inv_freq = self.rotary_pos_emb.inv_freq.to(position_ids.device)
        angles = position_ids.t().float()[..., None] * inv_freq
        return torch.cat([angles, angles], dim=-1).unsqueeze(2)
