"""Weight initialisation that does not depend on the parallel layout.

Every parameter is drawn whole from a generator seeded by (seed, its global name) and then sliced
to this rank's tensor-parallel shard, so TP=1, TP=2, PP=2 and any DP size start from identical
weights (and the equality tests compare like with like). The distributions follow the reference
DiT: PyTorch's nn.Linear default U(+-1/sqrt(fan_in)) for weights and biases, kaiming-uniform
(a=sqrt 5, i.e. U(+-1/sqrt(h))) for the embedding, ones for norms, zeros for every adaLN
modulation and for the output layer (adaLN-zero: initial logits are exactly 0). The GPT backbone
(`model/gpt.py`) is drawn the same way without adaLN-zero (norm biases zero, a tied output layer
is the embedding), its SwiGLU `linear_fc1` sharded as megatron does ([gate_i; up_i] per rank).
"""
from __future__ import annotations

import re
import zlib

import torch
from megatron.core import parallel_state


def _global_name(name: str, layer_offset: int, tied: bool) -> str:
    """The layout-independent name: global layer numbers (DiT `layers.N.`, GPT `decoder.layers.N.`);
    a tied output layer (its copy on the last pipeline stage) is the word embedding."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return re.sub(r"^(decoder\.)?layers\.(\d+)\.",
                  lambda m: f"{m.group(1) or ''}layers.{int(m.group(2)) + layer_offset}.", name)


def tp_shard(full: torch.Tensor, param: torch.Tensor, tp: int, tp_rank: int, gated_fc1: bool) -> torch.Tensor:
    """This rank's slice of a whole tensor, as megatron lays it out: contiguous chunks along the
    partition dimension, except a gated MLP's fc1 ([gate; up] whole, `gated_fc1`), whose rank i
    holds [gate_i; up_i] (megatron-core's swiglu sharding)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    if gated_fc1:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=param.partition_dim)[tp_rank]


def _full_shape(param: torch.Tensor, tp: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def _init_full(name: str, shape: list[int], fan_in: int | None, gen: torch.Generator,
               adaln_zero: bool) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.bias"):  # the GPT backbone's LayerNorm
        return torch.zeros(shape)
    if adaln_zero and ("adaLN_modulation" in name or "output_layer" in name):
        return torch.zeros(shape)
    if "word_embeddings" in name or "position_embeddings" in name:
        fan_in = shape[1]
    bound = 1.0 / fan_in ** 0.5
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, seed: int, adaln_zero: bool = True) -> None:
    """Initialise in place. `adaln_zero=False` draws the adaLN and output layers like any linear
    (tests use it: with zero gates every block is the identity and gradients stop at the head)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    gated = getattr(model.config, "gated_linear_unit", False)
    for name, param in params.items():
        gname = _global_name(name, model.layer_offset, tied)
        shape = _full_shape(param, tp)
        weight = params.get(name.rsplit(".", 1)[0] + ".weight", param)
        fan_in = _full_shape(weight, tp)[1] if weight.dim() == 2 else None
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(gname.encode())) % 2**63)
        full = _init_full(gname, shape, fan_in, gen, adaln_zero)
        full = tp_shard(full, param, tp, tp_rank, gated_fc1=gated and ".mlp.linear_fc1." in name)
        param.copy_(full.to(param.dtype))
