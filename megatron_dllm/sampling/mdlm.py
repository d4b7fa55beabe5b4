"""MDLM ancestral sampler with the no-change cache (as in the paper's code, "MDLM ancestral").

From t to s on linspace(1, 1e-5, T + 1), a masked token moves to
    q(id) ∝ p_x0(id) (alpha_s - alpha_t),   q([MASK]) = 1 - alpha_s,
and unmasked tokens are carried over (copy flag), so q is only formed at masked positions. The
model is not time-conditioned: when a step changes nothing, the next step reuses p_x0 instead of
calling the model again (`kv_cache=True`, the reference's `ancestral_cache`). After T steps the
remaining masks take the denoiser's argmax (greedy final step). Top-p and temperature act on p_x0.

Batched conditional generation (`sample_batch`): the canvases (prompt_i + masks up to L_i) are
right-padded and the padding is a key-padding mask, so with bidirectional attention no real token
sees it and positions stay 0..L_i-1; each row keeps its own p_x0, draws and stopping.
"""
from __future__ import annotations

import torch

from . import categorical
from .base import Sampler


def ancestral(sampler: Sampler, x: torch.Tensor, denoise, generator: torch.Generator) -> torch.Tensor:
    """The ancestral steps on x's masked positions, in place (BD3-LM runs them on one block);
    `denoise(x, masked)` gives p_x0 [n_masked, V] there."""
    ts = sampler.timesteps()
    p_x0 = None  # valid while x is unchanged since the model call that produced it
    for t, s in zip(ts[:-1], ts[1:]):
        masked = x == sampler.mask_id
        if not masked.any():
            break
        if p_x0 is None:
            p_x0 = denoise(x, masked)
        a_t, a_s = sampler.alpha(t), sampler.alpha(s)
        q = p_x0 * (a_s - a_t)
        q[:, sampler.mask_id] = 1 - a_s
        new = categorical.sample(q, generator)
        x[masked] = new
        if not sampler.cfg.kv_cache or bool((new != sampler.mask_id).any()):
            p_x0 = None
    masked = x == sampler.mask_id
    if masked.any():  # greedy final step at t = 1e-5
        x[masked] = (p_x0 if p_x0 is not None else denoise(x, masked)).argmax(-1)
    return x


class MDLMSampler(Sampler):
    def denoise(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """p_x0 at the masked positions of x: [n_masked, V] in the sampling dtype."""
        return self.probs(self.model(input_ids=x).logits[masked])

    block_wise = True

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.blocks:
            return self.sample_rows(prompt, generator)
        x = self.canvas(prompt)
        if self.cfg.predictor == "left-to-right":  # mask the remainder, fill one position per step
            return self.fill_left_to_right(x, prompt.shape[1], generator,
                                           lambda x, pos: self.model(input_ids=x).logits[:, pos])
        return ancestral(self, x, self.denoise, generator)

    def batch_logits(self, x: torch.Tensor, real: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, w, V] of the batch rows `rows`, cut to their longest canvas w, padding unseen."""
        width = int(real[rows].sum(1).max())
        return self.model(input_ids=x[rows, :width], attention_mask=real[rows, :width]).logits

    def sample_batch(self, batch) -> list[list[int]]:
        x, real = batch.canvas(self.mask_id)
        plen = batch.prompt_lengths()
        if self.cfg.predictor == "left-to-right":
            def next_logits(rows, pos, last):
                if last is not None:
                    x[rows, pos - 1] = last
                return self.batch_logits(x, real, rows)[torch.arange(len(rows), device=x.device), pos]

            return self.fill_batch_left_to_right(batch, next_logits)
        ts = self.timesteps()
        for rows, span, denoiser in self.batch_blocks(batch, x, real):
            p_x0: dict[int, torch.Tensor] = {}  # per row, as `sample` keeps it
            for t, s in zip(ts[:-1], ts[1:]):
                live = [r for r in rows if self.block_masks(x, r, span).any()]
                if not live:
                    break
                self.denoise_block(x, denoiser, [r for r in live if r not in p_x0], span, p_x0)
                a_t, a_s = self.alpha(t), self.alpha(s)
                for r in live:
                    q = p_x0[r] * (a_s - a_t)
                    q[:, self.mask_id] = 1 - a_s
                    new = batch.draw(q, r)
                    x[r, span[r][0]:span[r][1]][self.block_masks(x, r, span)] = new
                    if not self.cfg.kv_cache or bool((new != self.mask_id).any()):
                        del p_x0[r]
            left = [r for r in rows if self.block_masks(x, r, span).any()]
            self.denoise_block(x, denoiser, [r for r in left if r not in p_x0], span, p_x0)
            for r in left:  # greedy final step at t = 1e-5
                x[r, span[r][0]:span[r][1]][self.block_masks(x, r, span)] = p_x0[r].argmax(-1)
        return [x[r, plen[r]:batch.lengths[r]].tolist() for r in range(batch.size)]

    def block_masks(self, x: torch.Tensor, r: int, span: dict) -> torch.Tensor:
        """Which positions of row r's current block are still [MASK]."""
        return x[r, span[r][0]:span[r][1]] == self.mask_id

    def denoise_block(self, x, denoiser, rows: list[int], span: dict, p_x0: dict) -> None:
        """p_x0[r] = p_x0 at the masked positions of row r's block, for the batch rows `rows`."""
        if rows:
            logits = denoiser.logits(rows, span)
            for r in rows:
                p_x0[r] = self.probs(logits[r][self.block_masks(x, r, span)])
