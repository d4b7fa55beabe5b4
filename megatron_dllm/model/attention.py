"""Core attention backends (`--attention-backend`), Megatron-LM's names plus PyTorch's SDPA.

    local                       megatron-core's DotProductAttention (matmul, masked softmax, matmul)
    sdpa                        SDPAttention below: torch's scaled_dot_product_attention, no TE needed
    unfused | fused | flash     TransformerEngine's DotProductAttention with that kernel family
    auto                        TransformerEngine's DotProductAttention, TE picks the kernel

Without TransformerEngine, `unfused/fused/flash/auto` are an error rather than a silent switch
to SDPA: a Megatron user asking for `fused` expects TE's cuDNN kernels and their numerics.
None of the backends holds parameters, so checkpoints load across backends.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch.nn.attention import sdpa_kernel

from megatron_dllm import platform
from megatron_dllm.errors import InputError

TE_BACKENDS = ("unfused", "fused", "flash", "auto")
ATTENTION_BACKENDS = ("local", "sdpa", *TE_BACKENDS)

# TransformerEngine reads its kernel choice from the environment (the values Megatron-LM sets);
# `auto` leaves the environment as it is (TE's default: every kernel allowed).
_TE_ENV = {"unfused": (0, 0, 1), "fused": (0, 1, 0), "flash": (1, 0, 0)}
_TE_ENV_NAMES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def resolve_backend(requested: str | None, use_te: bool) -> str:
    """The backend a run uses: the one asked for, else TE's own choice with TE layers, else local."""
    backend = requested or ("auto" if use_te else "local")
    if backend not in ATTENTION_BACKENDS:
        raise InputError(f"--attention-backend {backend}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if backend in TE_BACKENDS and not platform.HAS_TE:
        raise InputError(f"--attention-backend {backend} needs TransformerEngine on a CUDA GPU (not found); "
                         f"use --attention-backend sdpa (PyTorch's fused kernels) or local")
    return backend


def core_attention_module(backend: str) -> type:
    """The core-attention class for SelfAttention's spec; TE backends also set TE's kernel choice."""
    if backend == "local":
        return DotProductAttention
    if backend == "sdpa":
        return SDPAttention
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    for name, value in zip(_TE_ENV_NAMES, _TE_ENV.get(backend, ())):
        if os.environ.get(name, str(value)) != str(value):  # as Megatron-LM: a contradiction is an error
            raise InputError(f"--attention-backend {backend} needs {name}={value}, the environment has "
                             f"{name}={os.environ[name]}")
        os.environ[name] = str(value)
    return TEDotProductAttention


class SDPAttention(MegatronModule):
    """megatron-core's core-attention contract (DotProductAttention's constructor and forward:
    [s, b, heads/TP, d] in, [s, b, hidden/TP] out) on `F.scaled_dot_product_attention`.

    Causal attention is SDPA's `is_causal` and bidirectional attention passes no mask, so no s x s
    mask is built (Eso-LM's order is a physical permutation; it needs plain causal). An explicit
    megatron mask (True = masked out) is passed on as SDPA's boolean mask (True = attend).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        unsupported = [what for what, bad in (
            ("context parallelism", config.context_parallel_size != 1),
            (f"softmax_type {config.softmax_type}", config.softmax_type != "vanilla"),
            ("sliding-window attention",
             is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)),
        ) if bad]
        if unsupported:
            raise InputError(f"--attention-backend sdpa does not support {', '.join(unsupported)}; "
                             f"use a TransformerEngine backend")
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        # DotProductAttention's query-key layer scaling divides the scores by the layer number and
        # multiplies them back inside the softmax: the effective scale is the unscaled one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise InputError("--attention-backend sdpa does not support packed sequences or an attention bias; "
                             "use a TransformerEngine backend")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        mask, causal = None, False
        if attention_mask is not None:  # as DotProductAttention: an explicit mask is used alone
            mask = ~attention_mask
        elif mask_type == AttnMaskType.causal:
            # one query (a decode step) sees every key, as DotProductAttention; SDPA's is_causal
            # aligns top-left, which is only right for square attention
            if sq > 1 and sq != sk:
                raise InputError(f"--attention-backend sdpa: causal attention needs as many queries as keys "
                                 f"({sq} vs {sk}) without an explicit mask")
            causal = sq > 1
        elif mask_type != AttnMaskType.no_mask:
            raise InputError(f"--attention-backend sdpa: attention mask type {mask_type.name} needs an "
                             f"explicit attention_mask")
        # [s, b, n, d] -> [b, n, s, d]: a view, SDPA takes the strides as they are
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        # the same RNG stream as DotProductAttention's dropout (TP ranks differ, SP ranks agree)
        rng = (tensor_parallel.get_cuda_rng_tracker().fork()
               if dropout and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng, sdpa_kernel(platform.sdpa_backends(), set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=self.groups_per_partition != self.heads_per_partition)
        # [b, n, sq, d] -> [sq, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

