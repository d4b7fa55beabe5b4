"""Weight initialisation that does not depend on the parallel layout.

Every parameter is drawn whole from a generator seeded by (seed, its global name) and then sliced
to this rank's tensor-parallel shard, so TP=1, TP=2, PP=2 and any DP size start from identical
weights (and the equality tests compare like with like). The distributions follow the reference
DiT: PyTorch's nn.Linear default U(+-1/sqrt(fan_in)) for weights and biases, kaiming-uniform
(a=sqrt 5, i.e. U(+-1/sqrt(h))) for the embedding, ones for norms, zeros for every adaLN
modulation and for the output layer (adaLN-zero: initial logits are exactly 0).
"""
from __future__ import annotations

import re
import zlib

import torch
from megatron.core import parallel_state


def _global_name(name: str, layer_offset: int) -> str:
    return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + layer_offset}.", name)


def _full_shape(param: torch.Tensor, tp: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def _init_full(name: str, shape: list[int], fan_in: int | None, gen: torch.Generator,
               adaln_zero: bool) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if adaln_zero and ("adaLN_modulation" in name or "output_layer" in name):
        return torch.zeros(shape)
    if "word_embeddings" in name:
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
    for name, param in params.items():
        gname = _global_name(name, model.layer_offset)
        shape = _full_shape(param, tp)
        weight = params.get(name.rsplit(".", 1)[0] + ".weight", param)
        fan_in = _full_shape(weight, tp)[1] if weight.dim() == 2 else None
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(gname.encode())) % 2**63)
        full = _init_full(gname, shape, fan_in, gen, adaln_zero)
        if getattr(param, "tensor_model_parallel", False):
            full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
        param.copy_(full.to(param.dtype))
