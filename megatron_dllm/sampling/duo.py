"""Duo ancestral sampler: the exact uniform-state posterior, then a greedy tail (as in the paper's code).

The chain starts from tokens drawn uniformly from the V real ids ([MASK] is never a state). From
t to s on linspace(1, 1e-5, T + 1), with x = x_theta (the denoiser at sigma = -log alpha_t, in
the sampling dtype) and z the current token,
    q(j) = [a_t V x_z 1[j = z] + (a_t/a_s - a_t) 1[j = z] + (a_s - a_t) x_j + (1 - a_t/a_s)(1 - a_s)/V]
           / (a_t V x_z + 1 - a_t).
q is never formed: it is a mixture of three distributions whose weights depend on x_z alone,
    stay at z:               a_t V x_z + a_t/a_s - a_t
    draw from x:             a_s - a_t
    uniform over the V ids:  (1 - a_t/a_s)(1 - a_s)          (the three sum to the denominator),
so one uniform per position picks the part and one more the id within it (x's drawn as every
sampler draws, `categorical.draw`). The samples have the distribution of the paper's sampler
(not its random stream), and x in float64 is formed a chunk of positions at a time (the
posterior and the race made two more buffers of its whole size).
Every position may change at every step, so there is nothing to cache (the model is time-
conditioned); `kv_cache` has no effect here. The greedy tail replaces every generated token by
the denoiser's argmax at t = 1e-5 (the duo repository's recommendation); `noise_removal=
"ancestral"` takes one more posterior step from t = 1e-5 to alpha_s = 1 instead (the paper
code's config default), which keeps nearly every token. Top-p and temperature act on x_theta (as in the duo repository;
the paper's code applies top-p to q instead). Left-to-right mode keeps the uniform noise as the
remainder and fills one position per step, with alpha = the fraction of positions already clean.

Batched conditional generation (`sample_batch`): each row's noise comes from its own generator,
the canvases are right-padded and the padding is a key-padding mask (bidirectional attention, so
no real token sees it); the time input is per row (left to right: each row's clean fraction).
"""
from __future__ import annotations

import math

import torch

from .base import Sampler
from .deps import real_ids
from .positions import flat_positions


def mixture(x_z: torch.Tensor, a_t: float, a_s: float, num_real: int):
    """The weights (stay at z, draw from x, uniform id) of q(z_s | z_t = z) at each position, from
    x_z = x_theta[z]; they sum to q's normaliser a_t V x_z + 1 - a_t."""
    return a_t * num_real * x_z + (a_t / a_s - a_t), a_s - a_t, (1 - a_t / a_s) * (1 - a_s)


def draw(sampler: Sampler, logits: torch.Tensor, z: torch.Tensor, a_t: float, a_s: float, generator) -> torch.Tensor:
    """One draw per position of z [b, n] from q(z_s | z_t = z, x ~ x_theta) (`mixture`), from
    `generator`: a uniform picks the part; `sampler.draw` gives x_theta's draw (the sampler's
    distribution of logits [b, n, V], a chunk of positions at a time) and x_theta[z], and
    `uniform_ids` the uniform one."""
    pick = torch.rand(z.shape, generator=generator, dtype=sampler.dtype, device=z.device)
    from_model, x_z = sampler.draw(logits, generator, at=z)
    stay, model, noise = mixture(x_z, a_t, a_s, sampler.family.num_real)
    pick = pick * (stay + model + noise)
    uniform = uniform_ids(*z.shape, sampler.family, generator, z.device)
    return torch.where(pick < stay, z, torch.where(pick < stay + model, from_model, uniform))


def uniform_ids(b: int, n: int, family, generator, device) -> torch.Tensor:
    """[b, n] ids uniform over the family's V real ids (every id < vocab_size except [MASK])."""
    return real_ids(torch.rand(b, n, generator=generator, dtype=torch.float64, device=device), family.mask_id,
                    family.vocab_size)


def ancestral(sampler: Sampler, x: torch.Tensor, p: int, logits_at, generator: torch.Generator) -> torch.Tensor:
    """The ancestral steps on x[:, p:], in place, then the greedy tail (BD3-LM runs them on one
    block); `logits_at(x, alpha)` gives the logits [b, n - p, V] of those positions."""
    ts = sampler.timesteps()
    for t, s in zip(ts[:-1], ts[1:]):
        a_t, a_s = sampler.alpha(t), sampler.alpha(s)
        x[:, p:] = draw(sampler, logits_at(x, a_t), x[:, p:], a_t, a_s, generator)
    a_final = sampler.alpha(ts[-1])
    x[:, p:] = sampler.remove_noise(logits_at(x, a_final), x[:, p:], a_final, generator)
    return x


class DuoSampler(Sampler):
    block_wise = True
    noise_removal_step = True

    def remove_noise(self, logits: torch.Tensor, z: torch.Tensor, a_t: float, generator) -> torch.Tensor:
        """The final ids from z [b, n] at t = 1e-5 (logits [b, n, V]): the greedy tail, or the
        posterior step to alpha_s = 1."""
        if self.cfg.noise_removal == "greedy":
            return self.greedy(logits)
        return draw(self, logits, z, a_t, 1.0, generator)

    @staticmethod
    def sigma(x: torch.Tensor, alpha: float) -> torch.Tensor:
        """The time input [b] of every row of x at alpha."""
        return torch.full((x.shape[0],), -math.log(alpha), device=x.device)

    def uniform_ids(self, b: int, n: int, generator, device) -> torch.Tensor:
        return uniform_ids(b, n, self.family, generator, device)

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.blocks:
            return self.sample_rows(prompt, generator)
        b, p = prompt.shape
        x = self.canvas(prompt, self.uniform_ids(b, self.length - p, generator, prompt.device))
        if self.cfg.predictor == "left-to-right":
            floor = self.alpha(1.0)
            return self.fill_left_to_right(x, p, generator, lambda x, pos: self.logits_at_column(
                x, pos, sigma=self.sigma(x, max(pos / self.length, floor))))
        # the prompt's positions need no logits
        at = None if p == 0 else flat_positions(torch.arange(p, self.length, device=x.device).expand(b, -1),
                                                self.length)
        x = ancestral(self, x, p, lambda x, a: self.model(input_ids=x, sigma=self.sigma(x, a), logits_at=at)
                      .logits.view(b, self.length - p, -1), generator)
        return self.end_rows_at_eos(x, p)

    def uniform_prior(self, batch) -> list[torch.Tensor]:  # also the remasking samplers' fillers
        """Each row's starting noise over its positions to generate, drawn from its own generator."""
        return [self.uniform_ids(1, n - len(p), g, batch.device)[0]
                for p, n, g in zip(batch.prompts, batch.lengths, batch.generators)]

    def sample_batch(self, batch) -> list[list[int]]:
        plen, lengths = batch.prompt_lengths().tolist(), batch.lengths
        x, real = batch.canvas(self.uniform_prior(batch))
        if self.cfg.predictor == "left-to-right":
            floor = self.alpha(1.0)

            def next_logits(rows, pos, last):
                if last is not None:
                    x[rows, pos - 1] = last
                alphas = [max(q / lengths[r], floor) for r, q in zip(rows.tolist(), pos.tolist())]
                return self.batch_logits(x, real, rows, pos[:, None], alphas)

            return self.fill_batch_left_to_right(batch, next_logits)
        ts = self.timesteps()
        for rows, span, denoiser in self.batch_blocks(batch, x, real):
            for t, s in zip(ts[:-1], ts[1:]):
                a_t, a_s = self.alpha(t), self.alpha(s)
                logits = denoiser.logits(rows, span, sigma=-math.log(a_t))
                for r in rows:
                    lo, hi = span[r]
                    x[r, lo:hi] = draw(self, logits[r][None], x[r:r + 1, lo:hi], a_t, a_s, batch.generators[r])[0]
            a_final = self.alpha(ts[-1])
            logits = denoiser.logits(rows, span, sigma=-math.log(a_final))
            for r in rows:  # the final step (greedy tail)
                lo, hi = span[r]
                x[r, lo:hi] = self.remove_noise(logits[r][None], x[r:r + 1, lo:hi], a_final, batch.generators[r])[0]
        return [x[r, p:n].tolist() for r, (p, n) in enumerate(zip(plen, lengths))]
