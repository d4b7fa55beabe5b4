"""MDLM ancestral sampler with the no-change cache (as in the paper's code, "MDLM ancestral").

From t to s on linspace(1, 1e-5, T + 1), a masked token moves to
    q(id) ∝ p_x0(id) (alpha_s - alpha_t),   q([MASK]) = 1 - alpha_s,
and unmasked tokens are carried over (copy flag), so q is only formed at masked positions. The
model is not time-conditioned: when a step changes nothing, the next step reuses p_x0 instead of
calling the model again (`kv_cache=True`, the reference's `ancestral_cache`). After T steps the
remaining masks take the denoiser's argmax (greedy final step). Top-p and temperature act on p_x0.
"""
from __future__ import annotations

import torch

from megatron_dllm.sampling import categorical
from megatron_dllm.sampling.base import Sampler


class MDLMSampler(Sampler):
    def denoise(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """p_x0 at the masked positions of x: [n_masked, V] in the sampling dtype."""
        return self.probs(self.model(input_ids=x).logits[masked])

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        x = self.canvas(prompt)
        if self.cfg.predictor == "left-to-right":  # mask the remainder, fill one position per step
            return self.fill_left_to_right(x, prompt.shape[1], generator,
                                           lambda x, pos: self.model(input_ids=x).logits[:, pos])
        ts = self.timesteps()
        p_x0 = None  # valid while x is unchanged since the model call that produced it
        for t, s in zip(ts[:-1], ts[1:]):
            masked = x == self.mask_id
            if not masked.any():
                break
            if p_x0 is None:
                p_x0 = self.denoise(x, masked)
            a_t, a_s = self.alpha(t), self.alpha(s)
            q = p_x0 * (a_s - a_t)
            q[:, self.mask_id] = 1 - a_s
            new = categorical.sample(q, generator)
            x[masked] = new
            if not self.cfg.kv_cache or bool((new != self.mask_id).any()):
                p_x0 = None
        masked = x == self.mask_id
        if masked.any():  # greedy final step at t = 1e-5
            x[masked] = (p_x0 if p_x0 is not None else self.denoise(x, masked)).argmax(-1)
        return x
