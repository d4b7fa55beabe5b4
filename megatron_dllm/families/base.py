"""The family protocol shared by training, evaluation and sampling, and the noise it draws on.

A family turns clean tokens into a `ModelInput` (`corrupt`), and scores the backbone's
vocab-parallel logits with its training objective (`loss`) and its evaluation bound (`nelbo`);
its traits (attention layout, losses, bound, next-token, extra token, variable length) tell
training, evaluation and export how to treat it. Families sit below sampling, evaluation and the
HF export and import nothing from them: adding a family means one file and one registry line in
`families/__init__.py`, plus its sampler in `sampling/` and one line in `sampling/registry.py`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from megatron_dllm.model.constants import T_EPS


@dataclass
class ModelInput:
    """One micro-batch as the backbone and the loss see it. All tensors are [b, s] unless noted."""

    input_ids: torch.Tensor     # z_t (diffusion) or x[:, :-1] (AR)
    position_ids: torch.Tensor  # rotary positions (permuted for Eso-LM)
    sigma: torch.Tensor         # [b] time input of the adaLN path (zeros for AR/MDLM/Eso-LM)
    targets: torch.Tensor       # clean tokens the loss scores
    valid: torch.Tensor         # float 1/0: tokens that count in the B*L denominator
    t: torch.Tensor             # [b] diffusion time (zeros for AR)

    def to(self, device) -> "ModelInput":
        return ModelInput(**{k: v.to(device) for k, v in self.__dict__.items()})


def response_positions(tokens: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    """Float 1/0 [b, L]: the positions that count in the loss (all of them without a prompt mask)."""
    if prompt is None:
        return torch.ones(tokens.shape, dtype=torch.float32)
    return (~prompt.bool()).float()


def seed_for(*values) -> int:
    """A 63-bit seed from values (stable across processes and Python versions)."""
    return zlib.crc32(b"/".join(str(v).encode() for v in values)) * 2_654_435_761 % 2**63


@dataclass
class Noise:
    """The randomness of one micro-batch, a pure function of (seed, global sample index).

    Every TP rank and PP stage that holds the same samples draws the same noise without
    communication; a resumed run draws exactly what the uninterrupted run would have.
    `strata` is each sample's position in its global batch of `num_strata` samples: t is
    stratified over the whole global batch (reference `_sample_t`), so each data-parallel rank
    and micro-batch gets its own strata of one global grid.
    """

    seed: int
    sample_ids: torch.Tensor  # [b] int64 global sample indices
    strata: torch.Tensor      # [b] int64 positions in the global batch
    num_strata: int

    def uniform(self, stream: str, length: int) -> torch.Tensor:
        """[b, length] U(0,1) draws, one generator per (seed, sample, stream)."""
        rows = []
        for sid in self.sample_ids.tolist():
            g = torch.Generator().manual_seed(seed_for(self.seed, sid, stream))
            rows.append(torch.rand(length, generator=g, dtype=torch.float64))
        return torch.stack(rows)

    def t(self) -> torch.Tensor:
        """[b] antithetic/stratified t in [T_EPS, 1]: (u + stratum) / n, then affine to [eps, 1]."""
        u = self.uniform("t", 1)[:, 0]
        t = (u + self.strata.double()) / self.num_strata
        return (1 - T_EPS) * t + T_EPS


class Family:
    """Base class of the four families; the protocol is this class's interface."""

    name: str
    attention: str           # "bidirectional" | "causal"
    extra_token: bool = False  # AR reads seq_length + 1 tokens per sample
    variable_length: bool = True  # --variable-seq-length-prob applies (reference: non-AR only)
    losses: tuple[str, ...] = ("nelbo",)  # training objectives; the first is the default
    bound: str               # what `nelbo` computes, as reports name it
    # a next-token model: its likelihood is exact (no t to draw) and it exports as a causal LM
    next_token: bool = False

    def __init__(self, mask_id: int, vocab_size: int, loss: str | None = None):
        self.mask_id, self.vocab_size = mask_id, vocab_size
        self.loss_type = loss or self.losses[0]

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        """The model input of clean `tokens` [b, L]. Supervised fine-tuning passes `prompt` (bool
        [b, L], True at prompt tokens): those are never corrupted and get valid = 0, so no loss is
        taken on them and the trainer's denominator counts response (and padding) positions only."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """Per-token training loss [b, s]; the trainer divides the sum by valid.sum()."""
        raise NotImplementedError

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """Per-token evaluation bound [b, s] (exact NLL for AR); same normalisation."""
        raise NotImplementedError
