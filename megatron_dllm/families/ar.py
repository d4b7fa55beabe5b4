"""Autoregressive family: causal attention, next-token cross-entropy, time input zero."""
from __future__ import annotations

import torch

from megatron_dllm.families import vocab_parallel
from megatron_dllm.families.base import Family, ModelInput, Noise, response_positions


class AR(Family):
    name = "ar"
    attention = "causal"
    bound = "exact NLL"
    next_token = True
    extra_token = True  # samples of seq_length + 1 tokens: inputs x[:-1], targets x[1:]
    variable_length = False
    losses = ("nll",)

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        b, s = inputs.shape
        # SFT: a target that is a prompt token carries no loss (next-token loss on the response only)
        valid = response_positions(targets, None if prompt is None else prompt[:, 1:])
        return ModelInput(
            input_ids=inputs, position_ids=torch.arange(s).expand(b, s), sigma=torch.zeros(b),
            targets=targets, valid=valid, t=torch.zeros(b),
        )

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return vocab_parallel.cross_entropy(logits, inp.targets, self.mask_id, self.vocab_size) * inp.valid

    nelbo = loss  # exact NLL
