"""Eso-LM (alpha_0 = 1) samplers with a KV cache (as in the paper's code, "Eso-LM sampler", "Block sampler").

A plan fixes, per sample, the order in which positions are decoded (`order` [b, L]: the prompt
first, then the generated positions) and, per step, how many are decoded (`counts`, shared by the
rows of a batch so that the cache slices line up). Positions are then decoded in that order with
the model attending causally over it, rotary at the original positions, exactly as in training
(clean tokens first, masks after). Plans:
  - ancestral: a random order per sample; counts ~ Binomial(remaining, (a_s - a_t) / (1 - a_t))
    on linspace(1, 1e-5, T + 1), the remainder in the last step; zero-count steps are skipped.
  - block: L' = T; each step decodes the L/T positions {s, s + T, s + 2T, ...} of one offset s,
    offsets in a random order per sample (T must divide L; with a prompt, also its length).
  - left-to-right: one position per step in sequence order, stopping at EOS.
Decoding with the KV cache runs each step on the tokens decoded in the previous step (now clean)
plus the masks to decode now, and keeps only the clean tokens' K/V, so every K/V is computed once.
Without the cache each step runs the whole permuted sequence; both give the same tokens.
"""
from __future__ import annotations

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.sampling import categorical
from megatron_dllm.sampling.base import EosStop, Sampler


class EsoLMSampler(Sampler):
    predictors = ("ancestral", "block", "left-to-right")

    def __init__(self, family, inf, cfg):
        super().__init__(family, inf, cfg)
        if cfg.predictor == "block" and (cfg.steps > self.length or self.length % cfg.steps):
            raise InputError(f"--predictor block needs --steps to divide the sequence length {self.length} "
                             f"(so steps <= {self.length}); got --steps {cfg.steps}")

    # ------------------------------------------------------------------ plans

    def plan(self, b: int, p: int, generator, device) -> tuple[torch.Tensor, list[int]]:
        """(order [b, L]: prompt positions first, then positions in decoding order; counts per step)."""
        def rand(*shape):
            return torch.rand(*shape, generator=generator, dtype=torch.float64, device=device)

        n = self.length - p
        if self.cfg.predictor == "left-to-right":
            return torch.arange(self.length, device=device).expand(b, -1), [1] * n
        prompt_order = rand(b, p).argsort(-1)  # clean tokens in a random order, as in training
        if self.cfg.predictor == "block":
            T = self.cfg.steps
            if p % T:
                raise InputError(f"--predictor block with a prompt needs the prompt length ({p} tokens) to "
                                 f"be a multiple of --steps {T}")
            offsets = rand(b, T).argsort(-1)
            rows = torch.arange(p // T, self.length // T, device=device)
            gen_order = (offsets[:, :, None] + T * rows).reshape(b, -1)
            return torch.cat([prompt_order, gen_order], 1), [n // T] * T
        gen_order = p + rand(b, n).argsort(-1)
        return torch.cat([prompt_order, gen_order], 1), self.binomial_counts(n, rand)

    def binomial_counts(self, remaining: int, rand) -> list[int]:
        ts = self.timesteps()
        counts = []
        for i, (t, s) in enumerate(zip(ts[:-1], ts[1:])):
            a_t, a_s = self.alpha(t), self.alpha(s)
            k = remaining if i == len(ts) - 2 else int((rand(remaining) < (a_s - a_t) / (1 - a_t)).sum())
            counts.append(k)
            remaining -= k
        return counts

    # ------------------------------------------------------------------ decoding

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        b, p = prompt.shape
        x = self.canvas(prompt)
        order, counts = self.plan(b, p, generator, x.device)
        stop = EosStop(self.eos_id, b, self.cfg.predictor == "left-to-right" and self.cfg.stop_at_eos, x.device)
        cache = KVCache(self.model.config.num_layers) if self.cfg.kv_cache else None
        start, done = 0, p  # sorted slots: [0, start) cached, [start, done) clean, not yet cached
        for k in counts:
            if k == 0:
                continue
            if cache is not None:
                sl = order[:, start:done + k]
                logits = self.model(input_ids=x.gather(1, sl), position_ids=sl, kv_cache=cache,
                                    kv_keep=done - start).logits[:, done - start:]
            else:
                logits = self.model(input_ids=x.gather(1, order), position_ids=order).logits[:, done:done + k]
            new = categorical.sample(self.probs(logits), generator)
            if stop.enabled:
                new = stop(new[:, 0])[:, None]
            x.scatter_(1, order[:, done:done + k], new)
            start, done = done, done + k
            if stop.done:
                x.scatter_(1, order[:, done:], self.eos_id)
                break
        return x
