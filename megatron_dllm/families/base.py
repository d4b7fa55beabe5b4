"""The family protocol shared by training, evaluation and sampling, and the noise it draws on.

A family turns clean tokens into a `ModelInput` (`corrupt`), and scores the backbone's
vocab-parallel logits with its training objective (`loss`) and its evaluation bound (`nelbo`);
its traits (attention layout, losses, bound, next-token, extra token, variable length) tell
training, evaluation and export how to treat it. Families sit below sampling, evaluation and the
HF export and import nothing from them: adding a family means one file and one registry line in
`families/__init__.py`, plus its sampler in `sampling/` and one line in `sampling/registry.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.model.constants import T_EPS
from megatron_dllm.seeding import seed_for


@dataclass
class ModelInput:
    """One micro-batch as the backbone and the loss see it. All tensors are [b, s] unless noted."""

    input_ids: torch.Tensor     # z_t (diffusion) or x[:, :-1] (AR)
    position_ids: torch.Tensor  # rotary positions (permuted for Eso-LM)
    sigma: torch.Tensor         # [b] time input of the adaLN path (zeros for AR/MDLM/Eso-LM)
    targets: torch.Tensor       # clean tokens the loss scores
    valid: torch.Tensor         # float 1/0: tokens that count in the B*L denominator
    t: torch.Tensor             # [b] diffusion time (zeros for AR); [b, s] when it varies per block (BD3-LM)
    # None: the family's attention layout; else a bool [1, 1, s, s] mask, True = masked out
    # (megatron's convention), for layouts that are neither causal nor bidirectional (BD3-LM)
    attention_mask: torch.Tensor | None = None

    def attend(self) -> torch.Tensor | None:
        """The explicit mask as SDPA and the dense model take it (True = may attend), or None."""
        return None if self.attention_mask is None else ~self.attention_mask

    def to(self, device) -> "ModelInput":
        return self.map(lambda tensor: tensor.to(device))

    def map(self, fn) -> "ModelInput":
        """The same input with `fn` applied to each tensor."""
        return ModelInput(**{k: None if v is None else fn(v) for k, v in self.__dict__.items()})


def response_positions(tokens: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    """Float 1/0 [b, L]: the positions that count in the loss (all of them without a prompt mask)."""
    if prompt is None:
        return torch.ones(tokens.shape, dtype=torch.float32)
    return (~prompt.bool()).float()


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
        return self.block_t(1)[:, 0]

    def block_t(self, num_blocks: int, lo: float = T_EPS, hi: float = 1.0) -> torch.Tensor:
        """[b, num_blocks] stratified t, one per (sample, block), in [lo, hi]: the global batch's
        samples x blocks share one grid (sample j's block k is stratum j * num_blocks + k, as BD3-LM's
        `_sample_t`). With one block this is `t()`, draw for draw."""
        u = self.uniform("t", num_blocks)
        strata = self.strata.double()[:, None] * num_blocks + torch.arange(num_blocks, dtype=torch.float64)
        t = (u + strata) / (self.num_strata * num_blocks)
        return (hi - lo) * t + lo


class Family:
    """Base class of the families; the protocol is this class's interface."""

    name: str
    attention: str           # "bidirectional" | "causal" | "block_diffusion"
    extra_token: bool = False  # AR reads seq_length + 1 tokens per sample
    variable_length: bool = True  # --variable-seq-length-prob applies (reference: non-AR only)
    losses: tuple[str, ...] = ("nelbo",)  # training objectives; the first is the default
    bound: str               # what `nelbo` computes, as reports name it
    # a next-token model: its likelihood is exact (no t to draw) and it exports as a causal LM
    next_token: bool = False
    # the model input is [x_t ; x_0] (BD3-LM): the backbone runs 2 x seq_length positions
    input_copies: int = 1
    # the logits at position i - 1 predict token i (an MDLM adapted from an AR model; families/shift.py)
    shift: bool = False
    # why the bound cannot score a sequence of any length (lm-eval's requests); None: it can
    any_length_refusal: str | None = None

    def __init__(self, mask_id: int, vocab_size: int, loss: str | None = None):
        self.check_loss(loss)
        self.mask_id, self.vocab_size = mask_id, vocab_size
        self.loss_type = loss or self.losses[0]

    @classmethod
    def check_loss(cls, loss: str | None) -> None:
        """`loss` is one of the family's training objectives (None: the default)."""
        if loss is not None and loss not in cls.losses:
            raise InputError(f"--loss {loss} is not available for --family {cls.name}; valid: {', '.join(cls.losses)}")

    @classmethod
    def options_from_flags(cls, model) -> dict:
        """The family's own settings from a run's flags (a `ModelConfig`), checked, as `get_family`
        takes them: none for most families, which refuse BD3-LM's flags set away from their defaults
        (a run_config.yaml would otherwise record settings the run never applied)."""
        for name in ("block_size", "noise", "sampling_eps_min", "sampling_eps_max"):
            if getattr(model, name) != getattr(type(model), name):  # the flag's default
                raise InputError(f"--{name.replace('_', '-')} applies to --family bd3lm only (this run: "
                                 f"--family {cls.name})")
        return {}

    def options(self) -> dict:
        """The settings beyond the name that fix what the model means (recorded in checkpoints and
        exports, passed back to `get_family`); none for most families."""
        return {}

    def evaluation(self) -> "Family":
        """The family as validation and evaluation use it (BD3-LM: t over the full range, not the
        clipped training range)."""
        return self

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        """The model input of clean `tokens` [b, L]. Supervised fine-tuning passes `prompt` (bool
        [b, L], True at prompt tokens): those are never corrupted and get valid = 0, so no loss is
        taken on them and the trainer's denominator counts response (and padding) positions only."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """Per-token training loss [b, s]; the trainer divides the sum by valid.sum(). `logits` are
        vocab-parallel [s, b, V/tp] and may be worked on in place (the losses keep their gradient
        in their storage): pass logits nothing else reads. The same holds for `nelbo`."""
        raise NotImplementedError

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        """Per-token evaluation bound [b, s] (exact NLL for AR); same normalisation."""
        raise NotImplementedError
