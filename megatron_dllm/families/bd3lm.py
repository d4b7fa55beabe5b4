"""Block diffusion (BD3-LM): autoregressive over blocks of B tokens, diffusion inside each block.

As in "Block Diffusion: Interpolating Between Autoregressive and Diffusion Language Models"
(Arriola et al., ICLR 2025) and its public code. One training pass scores every block at once:

    input_ids    = [x_t ; x_0]                  [b, 2L]   (the noised copy first)
    position_ids = [0..L-1 ; 0..L-1]            both copies at the original rotary positions
    mask         = block_diffusion_mask(L, B)   a noised block sees itself and the clean blocks
                                                strictly before it; a clean block sees its own and
                                                the earlier clean blocks (block-causal)

so x_t's block k is predicted from x_t^k and x_0^{<k}, and the logits of the x_0 copy are unused.
Each (sample, block) draws its own t (`Noise.block_t`, stratified over the global batch's
samples x blocks), optionally from the clipped range U[--sampling-eps-min, --sampling-eps-max]
that the paper recommends for lower-variance training. The forward process inside a block is
MDLM's (`--noise mask`) or Duo's (`--noise uniform`), and the per-block NELBO is theirs with the
block's t: `MDLM.nelbo` / `Duo.nelbo` on the x_t half with per-token t are called, not copied.
The backbone gets sigma = 0 (BD3-LM is not time-conditioned; with one t per block there is no
single time input per sequence).

Reductions (tests/test_bd3lm.py): with B = L the x_t half attends to itself only, so the bound
is MDLM's / Duo's NELBO for the same t and noise draws; with B = 1 (mask noise) a masked token
sees only the clean tokens before it, so the model is an autoregressive one and the expected
NELBO over the masking is (1 - eps) times its exact NLL (eps = the log-linear schedule's 1e-3).
"""
from __future__ import annotations

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families.base import Family, ModelInput, Noise, response_positions
from megatron_dllm.families.duo import Duo
from megatron_dllm.families.mdlm import MDLM
from megatron_dllm.model.constants import T_EPS

NOISES = {"mask": MDLM, "uniform": Duo}


def block_diffusion_mask(length: int, block_size: int, device=None) -> torch.Tensor:
    """Bool [2L, 2L], True = may attend, over [x_t ; x_0] (BD3-LM's mask).

    For an index i, half(i) = i >= L and blk(i) = (i mod L) // B. Query q sees key k iff
    the same block of the same half, or q noised and k an earlier clean block, or both clean and
    blk(k) <= blk(q).
    """
    idx = torch.arange(2 * length, device=device)
    clean, blk = idx >= length, (idx % length) // block_size
    q_clean, k_clean = clean[:, None], clean[None, :]
    q_blk, k_blk = blk[:, None], blk[None, :]
    same_block = (q_blk == k_blk) & (q_clean == k_clean)
    earlier_clean = ~q_clean & k_clean & (k_blk < q_blk)
    block_causal = q_clean & k_clean & (k_blk <= q_blk)
    return same_block | earlier_clean | block_causal


def blocks_in(length: int, block_size: int) -> int:
    """The number of blocks in `length` positions; `block_size` must divide it."""
    if length % block_size:
        raise InputError(f"--block-size {block_size} must divide --seq-length {length}")
    return length // block_size


class BD3LM(Family):
    name = "bd3lm"
    attention = "block_diffusion"
    bound = "BD3-LM NELBO"
    losses = ("nelbo",)
    variable_length = False  # a cut must keep whole blocks
    input_copies = 2
    any_length_refusal = "its NELBO needs sequences of whole blocks"

    def __init__(self, mask_id: int, vocab_size: int, loss: str | None = None, block_size: int | None = None,
                 noise: str = "mask", sampling_eps_min: float = T_EPS, sampling_eps_max: float = 1.0):
        super().__init__(mask_id, vocab_size, loss)
        self.check_settings(block_size, noise, sampling_eps_min, sampling_eps_max)
        self.block_size, self.noise = block_size, noise
        self.eps_min, self.eps_max = sampling_eps_min, sampling_eps_max
        self.inner = NOISES[noise](mask_id=mask_id, vocab_size=vocab_size)  # the in-block process and bound
        self.schedule = self.inner.schedule

    @classmethod
    def options_from_flags(cls, model) -> dict:
        """--block-size, --noise and --sampling-eps-min/max of a run (a `ModelConfig`), checked with
        its --seq-length (`config/validate.py` applies this through `ModelConfig.family_options`)."""
        options = {"block_size": model.block_size, "noise": model.noise,
                   "sampling_eps_min": model.sampling_eps_min, "sampling_eps_max": model.sampling_eps_max}
        cls.check_settings(**options, seq_length=model.seq_length)
        return options

    @staticmethod
    def check_settings(block_size: int | None, noise: str, sampling_eps_min: float, sampling_eps_max: float,
                       seq_length: int | None = None) -> None:
        """Every rule on BD3-LM's settings, for a run's flags and a constructed family alike."""
        if block_size is None or block_size < 1:
            raise InputError("--family bd3lm needs --block-size (tokens per block; it must divide --seq-length)")
        if seq_length:
            blocks_in(seq_length, block_size)
        if noise not in NOISES:
            raise InputError(f"--noise {noise!r}: choose one of {', '.join(NOISES)}")
        if not 0 < sampling_eps_min <= sampling_eps_max <= 1:
            raise InputError(f"--sampling-eps-min {sampling_eps_min} --sampling-eps-max {sampling_eps_max}: "
                             f"need 0 < min <= max <= 1")

    def num_blocks(self, length: int) -> int:
        return blocks_in(length, self.block_size)

    def options(self) -> dict:
        return {"block_size": self.block_size, "noise": self.noise}

    def evaluation(self) -> "BD3LM":
        """The same family with t over the full [eps, 1]: a reported NELBO is a bound only there."""
        return BD3LM(self.mask_id, self.vocab_size, self.loss_type, self.block_size, self.noise)

    def block_t(self, noise: Noise, length: int) -> torch.Tensor:
        """[b, L] per-token t: one draw per block from [eps_min, eps_max], repeated over its tokens."""
        t = noise.block_t(self.num_blocks(length), self.eps_min, self.eps_max)
        return t.repeat_interleave(self.block_size, dim=1)

    def noised(self, tokens: torch.Tensor, t: torch.Tensor, noise: Noise,
               prompt: torch.Tensor | None = None) -> torch.Tensor:
        """x_t for per-token times t [b, L], with the draws MDLM / Duo would take (same streams)."""
        length = tokens.shape[1]
        if self.noise == "mask":
            return self.inner.mask_at(tokens, t, noise.uniform("mask", length), prompt)
        return self.inner.replace_at(tokens, t, noise.uniform("replace", length),
                                     noise.uniform("replace_id", length), prompt)[0]

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        t = self.block_t(noise, tokens.shape[1])
        return self.model_input(tokens, self.noised(tokens, t, noise, prompt), t, prompt)

    def model_input(self, tokens: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                    prompt: torch.Tensor | None = None) -> ModelInput:
        """The two-copy input [x_t ; x_0] with its positions and mask (True = masked out)."""
        b, length = tokens.shape
        positions = torch.arange(length).repeat(2).expand(b, 2 * length)
        return ModelInput(
            input_ids=torch.cat([x_t, tokens], dim=1), position_ids=positions, sigma=torch.zeros(b),
            targets=tokens, valid=response_positions(tokens, prompt), t=t.float(),
            attention_mask=~block_diffusion_mask(length, self.block_size)[None, None],
        )

    def _noised_half(self, logits: torch.Tensor, inp: ModelInput) -> tuple[torch.Tensor, ModelInput]:
        """The logits [L, b, V/tp] of the x_t copy and the input as the in-block family sees it."""
        length = inp.targets.shape[1]
        inner = ModelInput(input_ids=inp.input_ids[:, :length], position_ids=inp.position_ids[:, :length],
                           sigma=inp.sigma, targets=inp.targets, valid=inp.valid, t=inp.t)
        return logits[:length], inner

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return self.inner.nelbo(*self._noised_half(logits, inp))

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return self.nelbo(logits, inp)
