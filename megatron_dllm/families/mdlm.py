"""Masked diffusion (MDLM): absorbing-state forward process, SUBS parameterisation.

Each token is replaced by [MASK] with probability 1 - alpha_t; the backbone is bidirectional and
gets sigma = 0. Only masked positions are scored; carry-over of unmasked tokens is done by the
loss mask (as in the paper's code). `--loss low-var` (default, the paper's) weights -log p by 1;
`--loss nelbo` by dalpha/(1 - alpha) = 1/t. Validation always reports the NELBO.
`--shift` (for a model adapted from an AR one, as Dream): the logits at position i - 1 predict
token i, so the AR head keeps its meaning; position 0 keeps its own logits (families/shift.py).
It is recorded with the model (`options`), so sampling and evaluation apply it too.
"""
from __future__ import annotations

import torch

from megatron_dllm.families import vocab_parallel
from megatron_dllm.families.base import Family, ModelInput, Noise, response_positions
from megatron_dllm.families.schedules import LogLinear
from megatron_dllm.families.shift import shift_right
from megatron_dllm.model.constants import T_EPS


class MDLM(Family):
    name = "mdlm"
    attention = "bidirectional"
    bound = "MDLM NELBO"
    losses = ("low-var", "nelbo")
    schedule = LogLinear(T_EPS)

    def __init__(self, mask_id: int, vocab_size: int, loss: str | None = None, shift: bool = False):
        super().__init__(mask_id, vocab_size, loss)
        self.shift = shift

    def options(self) -> dict:
        """{"shift": True} for a shifted model; nothing otherwise (as checkpoints written before
        the shift was recorded say: no shift)."""
        return {"shift": True} if self.shift else {}

    def mask(self, tokens: torch.Tensor, noise: Noise,
             prompt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_t, t): each token masked independently with probability 1 - alpha_t; prompt tokens
        (SFT) never are."""
        t = noise.t()
        return self.mask_at(tokens, t[:, None], noise.uniform("mask", tokens.shape[1]), prompt), t

    def mask_at(self, tokens: torch.Tensor, t: torch.Tensor, u: torch.Tensor,
                prompt: torch.Tensor | None = None) -> torch.Tensor:
        """z_t for times t ([b, 1] or per token [b, L]) and uniform draws u [b, L]."""
        masked = u < 1 - self.schedule.alpha(t)
        if prompt is not None:
            masked &= ~prompt.bool()
        return torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        z_t, t = self.mask(tokens, noise, prompt)
        b, s = tokens.shape
        return ModelInput(
            input_ids=z_t, position_ids=torch.arange(s).expand(b, s), sigma=torch.zeros(b),
            targets=tokens, valid=response_positions(tokens, prompt), t=t.float(),
        )

    def _masked_nll(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        if self.shift:  # logits are sequence-first [s, b, V/tp]
            logits = shift_right(logits, dim=0)
        nll = vocab_parallel.cross_entropy(logits, inp.targets, self.mask_id, self.vocab_size)
        return nll * (inp.input_ids == self.mask_id) * inp.valid

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        t = (inp.t if inp.t.dim() == 2 else inp.t[:, None]).to(torch.float32)  # per token or per sequence
        weight = -self.schedule.dalpha(t) / (1 - self.schedule.alpha(t))  # = 1/t
        return self._masked_nll(logits, inp) * weight

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        if self.loss_type == "nelbo":
            return self.nelbo(logits, inp)
        return self._masked_nll(logits, inp)
