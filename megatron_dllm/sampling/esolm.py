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

Batched conditional generation (`sample_batch`): each row plans with its own generator and canvas
length, so rows decode different counts per step. Each step feeds, per row, [its tokens decoded
last step (now clean) | the masks it decodes now], each part right-padded to the batch's widest,
through a `PaddedKVCache`: padding is masked out of attention and its K/V marked invalid, so
every row sees exactly what its batch-1 run sees. A row with nothing to decode in a step feeds
only padding; a row leaves the batch once decoded (or, left to right, at EOS). Both caches are
static: preallocated (`padded_cache_length` bounds the batched one from the plans) and written in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import EosStop, Sampler
from .deps import InputError
from .padded_kv_cache import PaddedKVCache
from .positions import flat_positions


class EsoLMSampler(Sampler):
    predictors = ("ancestral", "block", "left-to-right")

    def __init__(self, family, inf, cfg):
        super().__init__(family, inf, cfg)
        if cfg.predictor == "block":
            self._check_block_steps(self.length)

    def _check_block_steps(self, length: int) -> None:
        if self.cfg.steps > length or length % self.cfg.steps:
            raise InputError(f"--predictor block needs --steps to divide the sequence length {length} "
                             f"(so steps <= {length}); got --steps {self.cfg.steps}")

    # ------------------------------------------------------------------ plans

    def plan(self, b: int, p: int, generator, device, length: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """(order [b, L]: prompt positions first, then positions in decoding order; counts per step);
        L = `length` (default: the sampler's sequence length)."""
        def rand(*shape):
            return torch.rand(*shape, generator=generator, dtype=torch.float64, device=device)

        length = length or self.length
        n = length - p
        if self.cfg.predictor == "left-to-right":
            return torch.arange(length, device=device).expand(b, -1), [1] * n
        prompt_order = rand(b, p).argsort(-1)  # clean tokens in a random order, as in training
        if self.cfg.predictor == "block":
            T = self.cfg.steps
            self._check_block_steps(length)  # a batch's shorter rows too, not only its longest canvas
            if p % T:
                raise InputError(f"--predictor block with a prompt needs the prompt length ({p} tokens) to "
                                 f"be a multiple of --steps {T}")
            offsets = rand(b, T).argsort(-1)
            rows = torch.arange(p // T, length // T, device=device)
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
        cache = self.kv_cache(self.length) if self.cfg.kv_cache else None
        start, done = 0, p  # sorted slots: [0, start) cached, [start, done) clean, not yet cached
        for k in counts:
            if k == 0:
                continue
            if cache is not None:
                ids, positions = self.cached_slice(x, order[:, start:done + k], start)
                logits = self.model(input_ids=ids, position_ids=positions, kv_cache=cache, kv_keep=done - start,
                                    logits_at=self.masks_at(x, done - start, k, ids.shape[1])).logits
            else:
                logits = self.model(input_ids=x.gather(1, order), position_ids=order,
                                    logits_at=self.masks_at(x, done, k, self.length)).logits
            new = self.draw(logits.view(b, k, -1), generator)
            if stop.enabled:
                new = stop(new[:, 0])[:, None]
            x.scatter_(1, order[:, done:done + k], new)
            start, done = done, done + k
            if stop.done:
                x.scatter_(1, order[:, done:], self.eos_id)
                break
        return self.end_rows_at_eos(x, p)  # left to right: already so

    @staticmethod
    def masks_at(x: torch.Tensor, first: int, k: int, width: int) -> torch.Tensor:
        """`logits_at` of the k masks decoded in a step, from column `first` of each row of a
        [b, width] input (b = x's rows): the clean tokens before them need no logits (about half
        of a cached slice)."""
        return flat_positions(torch.arange(first, first + k, device=x.device).expand(x.shape[0], -1), width)

    def cached_slice(self, x: torch.Tensor, slots: torch.Tensor, cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) of one cached step's slice (the original positions `slots` [b, s]).
        Fixed-shape decoding pads it at the end to a power-of-two width (at most the cache's room
        after its `cached` entries), so that steps share a few shapes: padding comes after every
        real token, which attends causally and never sees it, and lies past `kv_keep`, so the next
        step overwrites its K/V."""
        ids = x.gather(1, slots)
        if not self.fixed_shape:
            return ids, slots
        width = min(1 << (slots.shape[1] - 1).bit_length(), self.length - cached)
        pad = (0, width - slots.shape[1])
        return F.pad(ids, pad, value=self.mask_id), F.pad(slots, pad, value=0)

    def sample_batch(self, batch) -> list[list[int]]:
        plen, lengths = batch.prompt_lengths().tolist(), batch.lengths
        x, _ = batch.canvas(self.mask_id)
        plans = [self.plan(1, p, g, batch.device, length=n) for p, n, g in zip(plen, lengths, batch.generators)]
        orders, counts = [order[0] for order, _ in plans], [c for _, c in plans]
        stop_at_eos = self.cfg.predictor == "left-to-right" and self.cfg.stop_at_eos and self.eos_id is not None
        start, done = [0] * batch.size, list(plen)  # per row, as in `sample`: [start, done) clean, not cached
        rows = list(range(batch.size))  # rows still decoding, in the cache's row order
        cache = PaddedKVCache(self.model, batch.size, batch.device,
                              self.kv_cache_length(padded_cache_length(plen, counts)))
        for step in range(max(len(c) for c in counts)):
            ks = [counts[r][step] if step < len(counts[r]) else 0 for r in rows]
            if not any(ks):
                continue
            clean = [done[r] - start[r] if k else 0 for r, k in zip(rows, ks)]  # k = 0: the row waits
            cw, kw = max(clean), max(ks)
            slots = torch.zeros(len(rows), cw + kw, dtype=torch.long, device=x.device)
            real = torch.zeros(len(rows), cw + kw, dtype=torch.bool, device=x.device)
            for j, (r, c, k) in enumerate(zip(rows, clean, ks)):
                slots[j, :c], slots[j, cw:cw + k] = orders[r][start[r]:start[r] + c], orders[r][done[r]:done[r] + k]
                real[j, :c], real[j, cw:cw + k] = True, True
            ids = torch.where(real, x[rows].gather(1, slots), batch.pad_id)
            masks = [cw + torch.arange(k, device=x.device) for k in ks]
            logits = cache.forward(ids, slots, real, keep=cw, logits_at=flat_positions(masks, cw + kw)).split(ks)
            going = []
            for j, (r, k) in enumerate(zip(rows, ks)):
                if k:
                    new = self.draw(logits[j][None], batch.generators[r])[0]
                    x[r, orders[r][done[r]:done[r] + k]] = new
                    start[r], done[r] = done[r], done[r] + k
                    if done[r] == lengths[r] or (stop_at_eos and int(new[0]) == self.eos_id):
                        continue
                going.append(r)
            cache.keep_rows(torch.tensor([r in going for r in rows], device=x.device))
            rows = going
            if not rows:
                break
        return [x[r, p:n].tolist() for r, (p, n) in enumerate(zip(plen, lengths))]


def padded_cache_length(prompt_lengths: list[int], counts: list[list[int]]) -> int:
    """The entries `sample_batch`'s cache must hold: each step keeps the widest slice of tokens
    decoded last step and feeds the widest slice of masks after it. Every row is taken to run to
    its end, an upper bound when rows stop at EOS."""
    start, done = [0] * len(counts), list(prompt_lengths)
    cached = most = 0
    for step in range(max(len(c) for c in counts)):
        ks = [c[step] if step < len(c) else 0 for c in counts]
        if not any(ks):
            continue
        clean = max(d - s if k else 0 for s, d, k in zip(start, done, ks))
        most, cached = max(most, cached + clean + max(ks)), cached + clean
        for r, k in enumerate(ks):
            if k:
                start[r], done[r] = done[r], done[r] + k
    return most
