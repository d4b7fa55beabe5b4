"""Confidence-based samplers for MDLM and Duo, decoded block by block (LLaDA style, no cache).

The generated region (after the prompt) is split into blocks of `--block-length` positions (the
last one may be shorter; default one block), decoded left to right: a block is finished before
the next starts, while the model always sees the whole canvas (bidirectional attention, later
blocks still masked/noised). Each step runs the model once, draws a candidate x0 at every open
position of the current block from `probs` (float64 categorical draw, temperature, top-p; the
greedy top-p of one id gives the argmax), and commits the positions a rule picks; the others stay
open (MDLM: [MASK], Duo: their noise token). A committed token never changes. The rule reads the
model's own distribution p (temperature 1, [MASK] excluded, no top-p), as LLaDA and Fast-dLLM do:
  - low-confidence (LLaDA, "Large Language Diffusion Models"): the k positions of highest p(x0).
    k per step: `--tokens-per-step k` (the last step of a block takes what is left), or from
    `--steps T`: block i gets T // n_blocks steps (one more for the first T % n_blocks blocks; at
    least 1, at most its size), and its m positions go ⌊m/s⌋ per step, one more on the first
    m mod s steps (LLaDA's `get_num_transfer_tokens`, which asserts divisibility instead).
  - threshold (Fast-dLLM): every position with p(x0) > tau, and at least the most confident one;
    tau = 1 commits exactly one per step. The step count follows from the model, not `--steps`.
  - entropy-bound ("Accelerated Sampling from Masked Diffusion Models via Entropy Bounded
    Unmasking"): positions in increasing entropy H of p; the longest prefix whose entropies,
    less the largest of them, sum to at most gamma (so at least one; gamma = 0: one per step
    unless entropies are exactly 0).
Duo (uniform noise) has no [MASK]: its open positions hold uniform noise, the model's time input is
alpha = the clean fraction of the canvas (as Duo's left-to-right predictor), and the rules pick
which open positions to commit; nothing is re-noised. A row stops early (`stop_at_eos`, always
on in conditional generation) once every position up to a committed EOS is committed: what
follows is cut anyway, so its open positions become EOS without further model calls.

`sample` and `sample_batch` share one loop over a `PromptBatch`: rows of different lengths run
together with padding as a key-padding mask, each row drawing from its own generator in the order
and shapes of its batch-1 run, so a batch gives exactly the batch-1 samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import categorical
from .base import Sampler
from .blocks import block_spans, end_at_eos
from .config import REMASKING_PREDICTORS
from .deps import InputError
from .duo import DuoSampler
from .mdlm import MDLMSampler
from .prompt_batch import PromptBatch

# ------------------------------------------------------------------ selection rules (indices into the open positions)


def most_confident(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """The k positions of highest confidence (ties: the earlier position first)."""
    return confidence.sort(descending=True, stable=True).indices[:k]


def above_threshold(confidence: torch.Tensor, tau: float) -> torch.Tensor:
    """Every position with confidence > tau, and at least the most confident one."""
    return most_confident(confidence, max(1, int((confidence > tau).sum())))


def entropy_bounded(entropy: torch.Tensor, gamma: float) -> torch.Tensor:
    """The longest prefix in increasing entropy with sum(H) - max(H) <= gamma (at least one)."""
    order = entropy.sort(stable=True)
    earlier = order.values.cumsum(0) - order.values  # sorted: the prefix's max is its last entry
    return order.indices[:int((earlier <= gamma).sum())]


def block_counts(size: int, steps: int) -> list[int]:
    """Tokens per step for `size` positions in `steps` steps (at most `size`): LLaDA's schedule."""
    steps = min(steps, size)
    return [size // steps + (i < size % steps) for i in range(steps)]


# ------------------------------------------------------------------ per-row plan


@dataclass
class _Row:
    """One canvas row's blocks [lo, hi) and, for low-confidence, the tokens of each step per block."""
    start: int
    end: int
    blocks: list[tuple[int, int]]
    counts: list[list[int]] | None
    block: int = 0
    step: int = 0
    done: bool = False


class RemaskingSampler(Sampler):
    """The loop; a family subclass gives `fillers` (the open positions' initial ids) and
    `step_logits` (the model's logits for some batch rows)."""

    predictors = REMASKING_PREDICTORS

    def fillers(self, batch: PromptBatch):
        raise NotImplementedError

    def step_logits(self, x, real, rows: torch.Tensor, columns: list[torch.Tensor],
                    clean_fractions: list[float]) -> torch.Tensor:
        """The logits [n, V] at each batch row's `columns` (`Sampler.batch_logits`)."""
        raise NotImplementedError

    def plan(self, start: int, end: int) -> _Row:
        blocks = block_spans(start, end, self.cfg.block_length)
        counts = None
        if self.cfg.predictor == "low-confidence":
            k = self.cfg.tokens_per_step
            if k is not None:
                counts = [[min(k, hi - lo - j) for j in range(0, hi - lo, k)] for lo, hi in blocks]
            else:
                n, T = len(blocks), self.cfg.steps
                counts = [block_counts(hi - lo, max(1, T // n + (i < T % n))) for i, (lo, hi) in enumerate(blocks)]
        return _Row(start, end, blocks, counts)

    def select(self, row: _Row, p: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """Indices (into the open positions) to commit, from p [n, V] and the drawn x0 [n]."""
        predictor = self.cfg.predictor
        if predictor == "entropy-bound":
            return entropy_bounded(torch.special.entr(p).sum(-1), self.cfg.gamma)
        confidence = p.gather(-1, x0[:, None])[:, 0]
        if predictor == "threshold":
            return above_threshold(confidence, self.cfg.threshold)
        return most_confident(confidence, row.counts[row.block][row.step])

    def decode(self, batch: PromptBatch) -> torch.Tensor:
        """The canvas [b, max L_i] after decoding every row (padding beyond L_i untouched). Each row
        moves through its blocks at its own pace (one model call serves every row's current block),
        so the rows keep their own block index rather than stepping together as `blocks.each_block`."""
        x, real = batch.canvas(self.fillers(batch))
        plen = batch.prompt_lengths()
        positions = torch.arange(x.shape[1], device=x.device)
        committed = positions[None] < plen[:, None]  # the prompt; the rest opens block by block
        rows = [self.plan(p, n) for p, n in zip(plen.tolist(), batch.lengths)]
        stop_at_eos = self.cfg.stop_at_eos and self.eos_id is not None
        live = [r for r, row in enumerate(rows) if row.start < row.end]
        while live:
            fractions = [float(committed[r, :rows[r].end].sum()) / rows[r].end for r in live]
            opens = [lo + (~committed[r, lo:hi]).nonzero()[:, 0]  # the open positions of each row's block
                     for r in live for lo, hi in [rows[r].blocks[rows[r].block]]]
            logits = self.step_logits(x, real, torch.tensor(live, device=x.device), opens, fractions)
            for r, open_, row_logits in zip(live, opens, logits.split([len(o) for o in opens])):
                row = rows[r]
                lo, hi = row.blocks[row.block]
                x0 = self.draw(row_logits, batch.generators[r])
                p = categorical.probabilities(row_logits, self.dtype, suppress=self.mask_id)
                chosen = self.select(row, p, x0)
                x[r, open_[chosen]], committed[r, open_[chosen]] = x0[chosen], True
                row.step += 1
                if bool(committed[r, lo:hi].all()):
                    row.block, row.step = row.block + 1, 0
                    row.done = row.block == len(row.blocks)
                if stop_at_eos:  # also at the last block's last step, where an EOS often settles
                    settled = int(committed[r, row.start:row.end].cumprod(0).sum())  # committed prefix
                    # an EOS there: all after it (committed earlier or open) becomes EOS
                    row.done = end_at_eos(x, r, row.start, row.start + settled, row.end, self.eos_id) or row.done
            live = [r for r in live if not rows[r].done]
        return x

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        b = prompt.shape[0]
        batch = PromptBatch(prompt.tolist(), [self.length] * b, [generator] * b, prompt.device)
        return self.decode(batch)

    def sample_batch(self, batch: PromptBatch) -> list[list[int]]:
        x = self.decode(batch)
        return [x[r, len(p):n].tolist() for r, (p, n) in enumerate(zip(batch.prompts, batch.lengths))]


class MDLMRemaskingSampler(RemaskingSampler, MDLMSampler):
    def fillers(self, batch):
        return self.mask_id

    def step_logits(self, x, real, rows, columns, clean_fractions):
        return self.batch_logits(x, real, rows, columns)


class DuoRemaskingSampler(RemaskingSampler, DuoSampler):
    def fillers(self, batch):
        return self.uniform_prior(batch)

    def step_logits(self, x, real, rows, columns, clean_fractions):
        floor = self.alpha(1.0)
        return self.batch_logits(x, real, rows, columns, [max(f, floor) for f in clean_fractions])


REMASKING_SAMPLERS = {"mdlm": MDLMRemaskingSampler, "duo": DuoRemaskingSampler}
WHY_NOT = {
    "ar": "AR generates one next token per model call; there are no open positions to rank",
    "esolm": "Eso-LM's samplers fix the decoding order before the model runs (what keeps its KV cache "
             "exact); use --predictor ancestral or block",
}


def remasking_sampler(family, inf, cfg) -> Sampler:
    if inf.family not in REMASKING_SAMPLERS:
        reason = WHY_NOT.get(inf.family, "it has no remasking sampler")
        raise InputError(f"--predictor {cfg.predictor} is not available for --family {inf.family}: {reason}")
    return REMASKING_SAMPLERS[inf.family](family, inf, cfg)
