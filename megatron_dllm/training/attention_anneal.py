"""Attention-mask annealing (`--attention-mask-anneal-iters N`): a model adapted from an
autoregressive one starts from its causal attention and opens up to the bidirectional attention
of MDLM and Duo over N iterations, as DiffuLLaMA ("Scaling Diffusion Language Models via
Adaptation from Autoregressive Models") trains.

Iteration k (Megatron's numbering: the first step is iteration 1, the number it is logged under)
attends through

    allowed_k[i, j] = (j <= i)  or  (u_k[i, j] < r_k),     r_k = min(1, k / N)

with u_k one [L, L] uniform draw per iteration, shared by every sample, micro-batch and rank
(DiffuLLaMA draws one Bernoulli(r_k) matrix per step for its whole batch, with
r = min(1, (global_step + 1) / anneal_steps) and the 0-based global step of the Hugging Face
trainer: the same r_k). So k = 0 would be exactly causal, every later pair opens with probability
k / N, and from iteration N on the attention is the family's bidirectional layout: no mask is
passed at all, and the model is the plain bidirectional one bit for bit. N = 1 is no annealing
(DiffuLLaMA's `anneal_steps: 1`).

u_k is drawn from (--seed, k): the mask is a pure function of the iteration, so a resumed run
attends exactly as the uninterrupted one. Validation and evaluation attend bidirectionally, as
DiffuLLaMA evaluates (ratio 1): the reported bound is the adapted model's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dllm.seeding import seed_for


def anneal_ratio(iteration: int, anneal_iters: int) -> float:
    """r_k: the probability that a pair above the diagonal is opened at iteration k."""
    return min(1.0, iteration / anneal_iters)


@dataclass
class AttentionAnneal:
    anneal_iters: int  # N
    seed: int
    _last: tuple = field(default=(None, None), repr=False, compare=False)  # ((k, L), mask): micro-batches share it

    def allowed(self, iteration: int, length: int) -> torch.Tensor:
        """Bool [L, L], True = may attend: allowed_k above."""
        ratio = anneal_ratio(iteration, self.anneal_iters)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if ratio == 0.0:
            return causal
        gen = torch.Generator().manual_seed(seed_for(self.seed, "attention_anneal", iteration))
        return causal | (torch.rand(length, length, generator=gen, dtype=torch.float64) < ratio)

    def attention_mask(self, iteration: int, length: int) -> torch.Tensor | None:
        """The mask of iteration k in megatron's convention (bool [1, 1, L, L], True = masked out),
        or None from iteration N on: the family's own bidirectional layout."""
        if anneal_ratio(iteration, self.anneal_iters) >= 1.0:
            return None
        if self._last[0] != (iteration, length):
            self._last = ((iteration, length), ~self.allowed(iteration, length)[None, None])
        return self._last[1]
