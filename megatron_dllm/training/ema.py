"""Exponential moving average of the weights (`--ema-decay D`).

An fp32 copy of every local parameter shard, updated after each successful optimizer step:
ema <- D * ema + (1 - D) * param. It is sharded exactly like the weights, so the checkpoint
holds it under the top-level key "ema" with the same sharded-state-dict structure as "model"
(the same dict keys, global layer numbers, TP/PP sharding), each ShardedTensor/ShardedObject key
prefixed "ema." -- it reshards across TP/PP/DP layouts like the weights. A ShardedTensorFactory
(SwiGLU's fc1, saved as its two halves) builds its halves from the EMA tensor under the prefixed key.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_dllm.errors import InputError

PREFIX = "ema."


class EMA:
    def __init__(self, model, decay: float):
        if not 0.0 < decay < 1.0:
            raise InputError(f"--ema-decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.modules = [chunk.module for chunk in model]  # DDP-wrapped chunks
        self.shadow: list[dict[int, torch.Tensor]] = []
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average at the current weights."""
        self.shadow = [{id(p): p.detach().float().clone() for p in m.parameters()} for m in self.modules]

    @torch.no_grad()
    def update(self) -> None:
        for module, shadow in zip(self.modules, self.shadow):
            for p in module.parameters():
                shadow[id(p)].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    def sharded_state_dict(self, model_key) -> dict:
        """{model_key(i): the model chunk's sharded state dict with the EMA tensors as data and
        every key prefixed "ema."}."""
        out = {}
        for i, (module, shadow) in enumerate(zip(self.modules, self.shadow)):
            sharded = {}
            for name, item in module.sharded_state_dict().items():
                if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                    data = shadow.get(id(item.data))
                    if data is None:  # not a parameter (a buffer): average of nothing, keep it
                        data = item.data.detach().clone()
                    item = dataclasses.replace(item, key=PREFIX + item.key, data=data)
                elif isinstance(item, ShardedObject):
                    item = dataclasses.replace(item, key=PREFIX + item.key)
                else:
                    raise TypeError(f"EMA: unexpected sharded entry {name}: {type(item).__name__}")
                sharded[name] = item
            out[model_key(i)] = sharded
        return out

    @torch.no_grad()
    def load(self, sharded: dict, loaded: dict) -> None:
        """Copy loaded tensors (dist_checkpointing.load of `sharded`; a factory's merged halves) into
        the shadow weights. A tensor loaded in place is there already: megatron-core's layer-stacked
        entries (the GPT backbone's) then hold a view of it with a leading layer axis."""
        for key, chunk in sharded.items():
            for name, item in chunk.items():
                if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                    continue
                source = loaded[key][name]
                if source.data_ptr() != item.data.data_ptr():
                    item.data.copy_(source.reshape(item.data.shape))
