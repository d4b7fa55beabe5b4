"""Micro-batches of one training iteration for this data-parallel rank.

The global batch of iteration i holds the samples [consumed, consumed + global_batch) in
Megatron's order (micro-batch m of DP rank r takes consumed + m*mbs*dp + r*mbs + [0, mbs)), so any
DP size x micro-batch count covers the same samples. Each sample's noise is drawn from its global
index and its position in the global batch (see families.base.Noise).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron_dllm import platform
from megatron_dllm.families.base import Family, ModelInput, Noise


class BatchSchedule:
    def __init__(self, dataset, family: Family, seed: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset, self.family, self.seed = dataset, family, seed
        self.mbs, self.gbs, self.dp_rank, self.dp_size = micro_batch_size, global_batch_size, dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)

    def micro_batch(self, consumed: int, m: int) -> ModelInput:
        start = consumed + m * self.mbs * self.dp_size + self.dp_rank * self.mbs
        ids = torch.arange(start, start + self.mbs, dtype=torch.int64)
        if int(ids[-1]) >= len(self.dataset):
            raise IndexError(f"sample {int(ids[-1])} requested but the dataset holds {len(self.dataset)}")
        tokens = torch.from_numpy(np.stack([self.dataset[int(i)] for i in ids]).astype(np.int64))
        noise = Noise(self.seed, ids, strata=ids - consumed, num_strata=self.gbs)
        return self.family.corrupt(tokens, noise).to(platform.device())

    def iteration(self, consumed: int) -> Iterator[ModelInput]:
        return (self.micro_batch(consumed, m) for m in range(self.num_microbatches))
