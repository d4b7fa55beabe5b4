"""Micro-batches of one training iteration for this data-parallel rank.

The global batch of iteration i holds the samples [consumed, consumed + global_batch) in
Megatron's order (micro-batch m of DP rank r takes consumed + m*mbs*dp + r*mbs + [0, mbs)), so any
DP size x micro-batch count covers the same samples. Each sample's noise is drawn from its global
index and its position in the global batch (see families.base.Noise).

`data_offset` is the global sample index at which the current data mix started (a phase-2 mix
switched in on resume is read from its first sample; the noise keeps using global indices).
`variable_length_prob` reproduces the reference's variable-length trick: with that probability
a micro-batch is cut to a length drawn from U[1, L] (rounded down to a multiple of
`length_multiple`, the TP size under sequence parallelism). The draw is a pure function of the
micro-batch's first sample, so every TP rank and PP stage cuts identically; no padding is
created, so nothing outside the cut counts in any loss or token average.

`attention_anneal` (`--attention-mask-anneal-iters`, training only) gives each micro-batch of
iteration k the annealed attention mask of that iteration (`attention_anneal.py`).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron_dllm import platform
from megatron_dllm.families.base import Family, ModelInput, Noise, seed_for
from megatron_dllm.training.attention_anneal import AttentionAnneal


class BatchSchedule:
    def __init__(self, dataset, family: Family, seed: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int, variable_length_prob: float = 0.0,
                 length_multiple: int = 1, attention_anneal: AttentionAnneal | None = None):
        self.dataset, self.family, self.seed = dataset, family, seed
        self.mbs, self.gbs, self.dp_rank, self.dp_size = micro_batch_size, global_batch_size, dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.variable_length_prob = variable_length_prob if family.variable_length else 0.0
        self.length_multiple = length_multiple
        self.data_offset = 0
        self.attention_anneal = attention_anneal

    def cut_length(self, first_sample: int, length: int) -> int:
        """The micro-batch's length: `length`, or with variable_length_prob a U[1, length] draw."""
        if not self.variable_length_prob:
            return length
        gen = torch.Generator().manual_seed(seed_for(self.seed, "length", first_sample))
        if torch.rand(1, generator=gen, dtype=torch.float64).item() >= self.variable_length_prob:
            return length
        cut = int(torch.randint(1, length + 1, (1,), generator=gen))
        return max(self.length_multiple, cut - cut % self.length_multiple)

    def micro_batch(self, consumed: int, m: int, number: int | None = None) -> ModelInput:
        start = consumed + m * self.mbs * self.dp_size + self.dp_rank * self.mbs
        ids = torch.arange(start, start + self.mbs, dtype=torch.int64)
        rows = ids - self.data_offset
        if int(rows[-1]) >= len(self.dataset):
            raise IndexError(f"sample {int(rows[-1])} requested but the dataset holds {len(self.dataset)}")
        prompt = None
        if getattr(self.dataset, "prompt_mask", False):  # SFT samples: (tokens, prompt mask)
            pairs = [self.dataset.sample(int(i)) for i in rows]
            tokens = torch.from_numpy(np.stack([p[0] for p in pairs]).astype(np.int64))
            prompt = torch.from_numpy(np.stack([p[1] for p in pairs]))
        else:
            tokens = torch.from_numpy(np.stack([self.dataset[int(i)] for i in rows]).astype(np.int64))
        extra = int(self.family.extra_token)
        cut = self.cut_length(start, tokens.shape[1] - extra) + extra
        tokens, prompt = tokens[:, :cut], None if prompt is None else prompt[:, :cut]
        noise = Noise(self.seed, ids, strata=ids - consumed, num_strata=self.gbs)
        inp = self.family.corrupt(tokens, noise, prompt)
        if self.attention_anneal is not None:
            if number is None:
                raise ValueError("an annealed attention mask needs the iteration's number")
            inp.attention_mask = self.attention_anneal.attention_mask(number, inp.input_ids.shape[1])
        return inp.map(platform.to_device)

    def iteration(self, consumed: int, number: int | None = None) -> Iterator[ModelInput]:
        """The micro-batches of the iteration that starts at `consumed` samples; `number` is that
        iteration's number (1-based, as logged), which the attention-mask annealing reads."""
        return (self.micro_batch(consumed, m, number) for m in range(self.num_microbatches))
