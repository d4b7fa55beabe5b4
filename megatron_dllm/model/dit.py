"""The DiT backbone. It knows nothing about diffusion: token ids, per-token position ids, a
per-sequence sigma and an attention layout go in; vocab-parallel logits come out.

    c      = SiLU(TimestepEmbedder(sigma))                        [b, COND_DIM], on every PP stage
    x      = VocabParallelEmbedding(ids)                          [s, b, h]  (first stage)
    x      = DiTLayer(x, c, rotary(position_ids))  x num_layers   (this stage's layers)
    logits = Linear(mod(LN(x), adaLN_2(c)))                       [s, b, V/tp] (last stage)

The time embedder is replicated on every pipeline stage (each stage needs c) and kept in sync by
megatron's conditional-embedder gradient all-reduce (`config.has_cond_embedder`).
"""
from __future__ import annotations

import math
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dllm.model.constants import COND_DIM, ROTARY_BASE, TIME_FREQ_DIM, TIME_MAX_PERIOD
from megatron_dllm.model.layer import AdaLNModulation, DiTLayerNorm, tag_replicated


class TimestepEmbedder(torch.nn.Module):
    """Sinusoidal embedding of sigma ([cos, sin], max period 1e4) -> Linear -> SiLU -> Linear."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(TIME_FREQ_DIM, COND_DIM, dtype=config.params_dtype),
            torch.nn.SiLU(),
            torch.nn.Linear(COND_DIM, COND_DIM, dtype=config.params_dtype),
        )
        tag_replicated(self, config)
        for p in self.parameters():
            p.pipeline_parallel = True  # replicated over PP stages; megatron syncs the grads

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(TIME_MAX_PERIOD) * torch.arange(half, dtype=torch.float32,
                                                                   device=sigma.device) / half)
        args = sigma.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class FinalLayer(MegatronModule):
    """LN -> adaLN (shift, scale) -> Linear(h, V) with bias, all zero-initialised."""

    def __init__(self, config: TransformerConfig, padded_vocab_size: int):
        super().__init__(config=config)
        self.norm = DiTLayerNorm(config)
        self.adaLN_modulation = AdaLNModulation(config, chunks=2)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, padded_vocab_size, config=config, init_method=torch.nn.init.zeros_,
            bias=True, gather_output=False, skip_bias_add=False,
        )
        self.compiled = getattr(config, "compile_elementwise", False)  # set by builder.transformer_config

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)
        logits, _ = self.output_layer(self.norm.modulated(x, shift, scale, self.compiled))
        return logits


def rotary_freqs(position_ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotary angles for explicit per-token positions: [b, s] -> [s, b, 1, head_dim].

    Non-interleaved (rotate-half) layout over the full head dimension, base 1e4, in fp32;
    Eso-LM passes permuted positions so every token keeps its original position.
    """
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                   device=position_ids.device) / head_dim))
    angles = position_ids.t().float()[..., None] * inv_freq
    return torch.cat([angles, angles], dim=-1).unsqueeze(2)


class DiTModel(MegatronModule):
    """One pipeline chunk of the DiT (the whole model when there is no pipelining)."""

    model_type = ModelType.encoder_or_decoder  # what megatron's schedules expect
    share_embeddings_and_output_weights = False  # untied (as in the paper's code)

    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, mlp_config: TransformerConfig,
                 padded_vocab_size: int, max_sequence_length: int, pre_process: bool = True,
                 post_process: bool = True, vp_stage: int | None = None):
        super().__init__(config=config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.padded_vocab_size = padded_vocab_size
        self.head_dim = config.kv_channels
        self.time_embedder = TimestepEmbedder(config)
        for p in self.time_embedder.parameters():
            p.shared = not pre_process  # count the replicas once in the grad norm (first chunk)
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size=padded_vocab_size, max_sequence_length=max_sequence_length,
                position_embedding_type="none",
            )
        self.layer_offset = get_transformer_layer_offset(config, vp_stage)
        num_local = get_num_layers_to_build(config, vp_stage=vp_stage)
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=self.layer_offset + i + 1,
                         mlp_config=mlp_config)
            for i in range(num_local)
        )
        if post_process:
            self.final_layer = FinalLayer(config, padded_vocab_size)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron's pipeline schedules with the previous stage's activations."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                sigma: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids: [b, s]; sigma: [b]; attention_mask: None (the layout of the
        layer spec) or bool [1 or b, 1, s, s], True = masked out (BD3-LM's block mask). Returns
        logits [s, b, V/tp] (megatron's sequence-first layout, kept to avoid a logits-sized copy)
        on the last stage, hidden states [s, b, h] elsewhere."""
        c = torch.nn.functional.silu(self.time_embedder(sigma))
        x = self.embedding(input_ids, position_ids=None) if self.pre_process else self.input_tensor
        rotary = rotary_freqs(position_ids, self.head_dim)
        with get_fp8_context(self.config):  # FP8 autocast for every layer (no-op without --fp8-format)
            for start, stop, recompute in self._layer_groups():
                if recompute:  # keep only the group's input; recompute the rest in backward
                    x = tensor_parallel.checkpoint(partial(self._run_layers, start, stop), False, x, c, rotary,
                                                   attention_mask)
                else:
                    x = self._run_layers(start, stop, x, c, rotary, attention_mask)
        if not self.post_process:
            return x
        return self.final_layer(x, c)

    def _run_layers(self, start: int, stop: int, x, c, rotary, attention_mask=None):
        for layer in self.layers[start:stop]:
            x = layer(x, c, rotary, attention_mask)
        return x

    def _layer_groups(self) -> list[tuple[int, int, bool]]:
        """(start, stop, recompute) over this stage's layers, as megatron-core's TransformerBlock
        groups full recompute: `uniform` checkpoints every group of recompute_num_layers layers,
        `block` the first recompute_num_layers layers one by one and runs the rest normally.
        (Selective recompute happens inside megatron's SelfAttention: core attention only.)"""
        cfg, n = self.config, len(self.layers)
        if cfg.recompute_granularity != "full" or not self.training:
            return [(0, n, False)]
        k = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Checkpoint keys use global layer numbers, so checkpoints reshard across PP layouts;
        the time embedder is stored once (pipeline stage 0 holds the main replica); the
        vocabulary-sized tensors load across TP sizes whose padding differs."""
        sharded = {}
        for name, module in self.named_children():
            if name == "layers":
                continue
            sharded.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
                           if hasattr(module, "sharded_state_dict") and isinstance(module, MegatronModule)
                           else _replicated_sharded(module, f"{prefix}{name}.", sharded_offsets))
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        for key, ten in sharded.items():
            if key.startswith(f"{prefix}time_embedder."):
                ten.replica_id = (pp_rank * 1000 + (self.vp_stage or 0),) + tuple(ten.replica_id[1:])
            if key.startswith(f"{prefix}final_layer.output_layer."):
                # the vocabulary padding grows with TP (divisible-by x TP): load the rows both
                # layouts have and zero the rest, as megatron-core does for the embedding
                ten.allow_shape_mismatch = True
        for i, layer in enumerate(self.layers):
            local, global_ = f"{prefix}layers.{i}.", f"{prefix}layers.{self.layer_offset + i}."
            layer_sd = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(layer_sd, local, global_)
            sharded.update(layer_sd)
        return sharded


def _replicated_sharded(module: torch.nn.Module, prefix: str, sharded_offsets: tuple):
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    return make_sharded_tensors_for_checkpoint(module.state_dict(keep_vars=True), prefix,
                                               sharded_offsets=sharded_offsets)
