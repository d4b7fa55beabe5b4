"""MDLM ancestral sampler (the paper's code's "MDLM ancestral" with its no-change cache), drawn as
when each position unmasks, then what it becomes.

From t to s on linspace(1, 1e-5, T + 1), a masked token moves to
    q(id) ∝ p_x0(id) (alpha_s - alpha_t),   q([MASK]) = 1 - alpha_s,
and unmasked tokens are carried over (copy flag). q splits in two independent draws: the token
unmasks with probability (alpha_s - alpha_t) / (1 - alpha_t), and if it does its id ~ p_x0. The
first draw does not involve the model, and over the whole run it telescopes: a token masked at
t = 1 is still masked at s with probability (1 - alpha_s) / (1 - alpha_1). So one uniform u per
masked position, drawn up front, fixes the step at which it unmasks (`UnmaskingPlan`: the first
step whose s has u >= (1 - alpha_s) / (1 - alpha_1)), and a step only draws ids where positions
unmask. The samples have the distribution of the paper's sampler (not its random stream), with:
  - the output layer (the model's `logits_at`) and the float64 softmax and draw only at the
    positions that unmask, not at every position (at T = L, one in L/2 of the masked ones on
    average), so the sampling buffers no longer bound the batch;
  - the model called only at steps where something unmasks: what the no-change cache saves, the
    same count of calls (the model is not time-conditioned, so a step that changes nothing needs
    no forward); `kv_cache=False` calls it at every step, as the paper's sampler without it;
  - no host synchronisation inside the loop: the plan's counts are read once, before it.
After T steps the remaining masks take the denoiser's argmax (greedy final step), or with
`noise_removal="ancestral"` a draw from p_x0 (the step to alpha_s = 1: the paper code's config
default; about 1e-5 of the masked positions reach it). Top-p and temperature act on p_x0.

Batched conditional generation (`sample_batch`): the canvases (prompt_i + masks up to L_i) are
right-padded and the padding is a key-padding mask, so with bidirectional attention no real token
sees it and positions stay 0..L_i-1; each row plans and draws from its own generator, block by
block, and only the rows that unmask at a step run the model.
"""
from __future__ import annotations

import torch

from .base import Sampler


class UnmaskingPlan:
    """When each of the masked `positions` (a 1-d tensor of indices) unmasks: step k = 0..T-1 of the
    time grid, or T (still masked after the last step: the greedy final step). One float64 uniform
    per position from `generator`; the counts per step are read to the host here, once."""

    def __init__(self, sampler: Sampler, positions: torch.Tensor, generator: torch.Generator):
        alphas = sampler.family.schedule.alpha(torch.tensor(sampler.timesteps(), dtype=torch.float64))
        # still masked after step k iff u < survive[k]; survive decreases with k
        survive = ((1 - alphas[1:]) / (1 - alphas[0])).to(positions.device)
        u = torch.rand(len(positions), generator=generator, dtype=torch.float64, device=positions.device)
        steps = len(survive) - torch.searchsorted(survive.flip(0), u, right=True)  # how many survive[k] > u
        self.positions = positions[steps.argsort(stable=True)]
        ends = torch.bincount(steps, minlength=len(survive) + 1).cumsum(0).tolist()
        self.slices = list(zip([0, *ends[:-1]], ends))

    def at(self, step: int) -> torch.Tensor:
        """The positions that unmask at `step` (`T`: those left for the greedy final step)."""
        lo, hi = self.slices[step]
        return self.positions[lo:hi]

    def unmasks(self, step: int) -> bool:
        lo, hi = self.slices[step]
        return hi > lo

    def masked_before(self, step: int) -> bool:
        """Whether any position is still masked when `step` begins."""
        return self.slices[step][0] < len(self.positions)


def ancestral(sampler: Sampler, x: torch.Tensor, logits_at, generator: torch.Generator) -> torch.Tensor:
    """The ancestral steps on x's masked positions, in place; `logits_at(x, at)` gives the model's
    logits [len(at), V] at the flat positions `at` of x."""
    flat = x.view(-1)
    plan = UnmaskingPlan(sampler, (flat == sampler.mask_id).nonzero().squeeze(1), generator)
    steps = sampler.cfg.steps
    for k in range(steps):
        if not plan.masked_before(k):
            break
        at = plan.at(k)
        if len(at):
            flat[at] = sampler.draw(logits_at(x, at), generator)
        elif not sampler.cfg.kv_cache:  # the paper's sampler without its cache: a call at every step
            logits_at(x, at)
    at = plan.at(steps)
    if len(at):  # final step at t = 1e-5
        flat[at] = sampler.remove_noise(logits_at(x, at), generator)
    return x


class MDLMSampler(Sampler):
    block_wise = True
    noise_removal_step = True

    def remove_noise(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The ids of the positions still masked at t = 1e-5, from their logits [n, V]: with alpha_s
        = 1 the ancestral step unmasks them all with ids ~ p_x0."""
        return self.greedy(logits) if self.cfg.noise_removal == "greedy" else self.draw(logits, generator)

    def logits_at(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The model's logits at the flat positions `at` of x [b, L]: [len(at), V], the output layer
        run only there (13% of the 1.7B forward's FLOPs at the 131k vocabulary, and its largest tensor)."""
        return self.model(input_ids=x, logits_at=at).logits

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.blocks:
            return self.sample_rows(prompt, generator)
        x = self.canvas(prompt)
        if self.cfg.predictor == "left-to-right":  # mask the remainder, fill one position per step
            return self.fill_left_to_right(x, prompt.shape[1], generator, self.logits_at_column)
        return self.end_rows_at_eos(ancestral(self, x, self.logits_at, generator), prompt.shape[1])

    def sample_batch(self, batch) -> list[list[int]]:
        x, real = batch.canvas(self.mask_id)
        plen = batch.prompt_lengths()
        if self.cfg.predictor == "left-to-right":
            def next_logits(rows, pos, last):
                if last is not None:
                    x[rows, pos - 1] = last
                return self.batch_logits(x, real, rows, pos[:, None])

            return self.fill_batch_left_to_right(batch, next_logits)
        steps = self.cfg.steps
        for rows, span, denoiser in self.batch_blocks(batch, x, real):
            blocks = {r: x[r, span[r][0]:span[r][1]] for r in rows}  # views: writes go to x
            plans = {r: UnmaskingPlan(self, (blocks[r] == self.mask_id).nonzero().squeeze(1), batch.generators[r])
                     for r in rows}
            for k in range(steps):
                live = [r for r in rows if plans[r].masked_before(k)]
                if not live:
                    break
                due = [r for r in live if plans[r].unmasks(k) or not self.cfg.kv_cache]
                if due:
                    at = {r: plans[r].at(k) for r in due}
                    logits = denoiser.logits(due, span, at=at)
                    for r in due:
                        if len(at[r]):
                            blocks[r][at[r]] = self.draw(logits[r], batch.generators[r])
            left = [r for r in rows if len(plans[r].at(steps))]
            if left:  # final step at t = 1e-5
                at = {r: plans[r].at(steps) for r in left}
                logits = denoiser.logits(left, span, at=at)
                for r in left:
                    blocks[r][at[r]] = self.remove_noise(logits[r], batch.generators[r])
        return [x[r, plen[r]:batch.lengths[r]].tolist() for r in range(batch.size)]
