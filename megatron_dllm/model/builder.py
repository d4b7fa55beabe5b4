"""TransformerConfig and model chunks from a preset and the parallel layout."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dllm import platform
from megatron_dllm.model.constants import LAYER_NORM_EPS
from megatron_dllm.model.dit import DiTModel
from megatron_dllm.model.fusion import Fusion, provide_weight_gradient_kernels
from megatron_dllm.model.gpt import GPTBackbone, gpt_layer_spec
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.model.layer import dit_layer_spec, gelu_tanh
from megatron_dllm.model.presets import Preset


@dataclass(frozen=True)
class Architecture:
    """What a checkpoint must match: sizes, vocabulary and attention layout."""

    preset: Preset
    vocab_size: int  # real vocabulary including [MASK], before TP padding
    seq_length: int
    attention: str  # "bidirectional" | "causal" | "block_diffusion"
    make_vocab_size_divisible_by: int = 128
    gpt: GPTShape | None = None  # the GPT (Llama-style) backbone's shape; None: the DiT

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def check_layout(arch: Architecture, tp: int, pp: int, vpp: int | None) -> None:
    """Impossible parallel layouts stop here, naming the flag (a run's are refused earlier, by
    config/validate.py)."""
    arch.preset.check_layout(tp, pp, vpp)
    if arch.gpt is not None:
        arch.gpt.check_layout(arch.preset.num_attention_heads, tp)


def transformer_config(arch: Architecture, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                       sequence_parallel: bool = False, bf16: bool = False,
                       fp8: str | None = None, fp8_recipe: str = "delayed",
                       fp8_amax_history_len: int = 1, fp8_amax_compute_algo: str = "most_recent",
                       recompute: dict | None = None, variable_seq_lengths: bool = False,
                       fusion: Fusion | None = None,
                       ) -> tuple[TransformerConfig, TransformerConfig]:
    """The block config (attention without bias) and the MLP's (with bias, fan-in 4h output);
    `fusion`: the fused elementwise work (default none: the eager reference)."""
    check_layout(arch, tp, pp, vpp)
    fusion = (fusion or Fusion()).for_backbone(arch.gpt)
    recompute, recompute_mlp_activation = megatron_recompute_fields(recompute)
    p = arch.preset
    dtype = platform.params_dtype(bf16)
    config = TransformerConfig(
        num_layers=p.num_layers, hidden_size=p.hidden_size, num_attention_heads=p.num_attention_heads,
        ffn_hidden_size=p.ffn_hidden_size, kv_channels=p.hidden_size // p.num_attention_heads,
        layernorm_epsilon=LAYER_NORM_EPS, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        activation_func=gelu_tanh, bias_activation_fusion=False, **fusion.config_fields(),
        persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        autocast_dtype=dtype,
        # megatron's own init also tags TP params (partition_dim ...); initialize_weights() then
        # overwrites the values with layout-independent ones.
        perform_initialization=True,
        calculate_per_token_loss=True,
        variable_seq_lengths=variable_seq_lengths,  # pipeline stages exchange activation shapes
        moe_token_dispatcher_type="alltoall",  # no MoE here; megatron's check for variable lengths
        # As Megatron-LM for the interleaved schedule: unbatched, overlapped p2p. Batched p2p posts
        # forward and backward messages to the same peer in an order that pairs them wrongly
        # when PP=2 (both neighbours are one rank).
        overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None,
        fp8=fp8, fp8_recipe=fp8_recipe, fp8_amax_history_len=fp8_amax_history_len,
        fp8_amax_compute_algo=fp8_amax_compute_algo,
        **(recompute or {}),  # recompute_granularity/method/num_layers (ModelConfig.recompute())
        **platform.megatron_config_overrides(),
    )
    if arch.gpt is not None:  # megatron-core's GPT layer: one config, no time embedder
        config = dataclasses.replace(config, **arch.gpt.config_fields(p.hidden_size, p.num_attention_heads),
                                     bias_activation_fusion=fusion.bias_swiglu)
        config.recompute_mlp_activation = recompute_mlp_activation  # read by layer.ActivationRecomputingMLP
        return config, config
    config.has_cond_embedder = True  # megatron syncs `pipeline_parallel` params over PP stages
    config.compile_elementwise = fusion.compile_elementwise  # read by DiTLayer and FinalLayer
    # megatron's fused bias-GELU is the tanh approximation, this model's GELU; megatron's MLP picks
    # it for activation_func F.gelu only (Megatron-LM's default GELU), so F.gelu names it here.
    mlp_config = dataclasses.replace(config, add_bias_linear=True, bias_activation_fusion=fusion.bias_gelu,
                                     activation_func=F.gelu if fusion.bias_gelu else gelu_tanh)
    mlp_config.recompute_mlp_activation = recompute_mlp_activation  # read by layer.ActivationRecomputingMLP
    return config, mlp_config


def megatron_recompute_fields(recompute: dict | None) -> tuple[dict, bool]:
    """(megatron-core's TransformerConfig recompute fields, whether the MLPs recompute their
    activation): `mlp_act` is this project's module name, which megatron-core's config refuses."""
    recompute = dict(recompute or {})
    modules = recompute.get("recompute_modules") or []
    if "mlp_act" not in modules:
        return recompute, False
    return {**recompute, "recompute_modules": [m for m in modules if m != "mlp_act"]}, True


def build_model(arch: Architecture, config: TransformerConfig, mlp_config: TransformerConfig,
                seed: int, use_te: bool = False, attention_backend: str | None = None) -> list:
    """This rank's model chunks (one per virtual pipeline stage: DiTModel, or GPTBackbone for
    `arch.gpt`), initialised from `seed`."""
    vpp = config.virtual_pipeline_model_parallel_size
    if config.gradient_accumulation_fusion:
        provide_weight_gradient_kernels()
    padded_vocab = arch.padded_vocab_size(config.tensor_model_parallel_size)
    if arch.gpt is None:
        spec = dit_layer_spec(arch.attention, use_te=use_te, attention_backend=attention_backend)
    else:
        spec = gpt_layer_spec(arch.gpt, arch.attention, use_te=use_te, attention_backend=attention_backend)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        if arch.gpt is None:
            model = DiTModel(config, spec, mlp_config, padded_vocab, arch.seq_length,
                             pre_process=first, post_process=last, vp_stage=stage)
        else:
            model = GPTBackbone(config, arch.gpt, spec, padded_vocab, arch.seq_length,
                                pre_process=first, post_process=last, vp_stage=stage, use_te=use_te)
        model.to(platform.device())
        initialize_weights(model, seed, adaln_zero=arch.gpt is None)
        chunks.append(model)
    return chunks
