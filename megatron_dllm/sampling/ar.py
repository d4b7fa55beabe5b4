"""AR sampler: next-token sampling with an optional KV cache (as in the paper's code, "AR sampler").

Start token: the training data are documents back to back, each ended by EOD and never started
by a BOS, so a document starts right after an EOD. Unconditional generation therefore starts
from one EOD token at position 0 (the reference starts from BOS, which our data never contain);
the output row keeps it and `decode` drops EOS tokens. With a prompt, generation starts right
after the prompt as given. Every row runs the full length L, across EOS tokens, as the paper's AR
samples do; `SamplingConfig(stop_at_eos=True)` (`--stop-at-eos`) stops a row at its first
generated EOS and fills the rest with EOS instead.

Batched conditional generation (`sample_batch`): the prompts, right-padded, are fed once into a
`PaddedKVCache` (padding masked out of every attention row, rotary at each row's own positions),
then every row feeds its last token at its own position; a row leaves the batch at EOS. Both
caches are static: preallocated to the final length and written in place.
"""
from __future__ import annotations

import torch

from .base import Sampler
from .deps import InputError
from .padded_kv_cache import PaddedKVCache
from .positions import flat_positions


class ARSampler(Sampler):
    predictors = ("ancestral", "left-to-right")  # both name the one left-to-right AR sampler

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if prompt.shape[1] == 0:
            if self.eos_id is None:
                raise InputError("AR generation without a prompt starts after an EOS token, and there is "
                                 "no tokenizer to name it: give --tokenizer-type/--tokenizer-model, a "
                                 "--prompt, or SamplingConfig.eos_id")
            prompt = torch.full((prompt.shape[0], 1), self.eos_id, dtype=torch.long, device=prompt.device)
        x = self.canvas(prompt)
        cache = self.kv_cache(self.length) if self.cfg.kv_cache else None
        fed = 0  # tokens the cache holds

        def next_logits(x, pos):
            # next-token logits after x[:, :pos]; with the cache only the tokens not yet fed run
            nonlocal fed
            if cache is None:
                return self.logits_at_column(x[:, :pos], pos - 1)
            logits = self.logits_at_column(x[:, fed:pos], pos - fed - 1, kv_cache=cache)
            fed = pos
            return logits

        return self.fill_left_to_right(x, prompt.shape[1], generator, next_logits)

    def sample_batch(self, batch) -> list[list[int]]:
        x, _ = batch.canvas(batch.pad_id)  # prompts, then padding
        plen = batch.prompt_lengths()
        longest = int((batch.canvas_lengths() - plen).max())  # the prompts' slice, then one token per step
        cache = PaddedKVCache(self.model, batch.size, batch.device, self.kv_cache_length(int(plen.max()) + longest))
        cached_rows = torch.arange(batch.size, device=batch.device)

        def next_logits(rows, pos, last):
            nonlocal cached_rows
            if last is None:  # the prompts, each at positions 0..P_i-1, padding masked
                width = int(plen.max())
                ids, at = x[:, :width], torch.arange(width, device=x.device).expand(batch.size, -1)
                return cache.forward(ids, at, at < plen[:, None], keep=width,
                                     logits_at=flat_positions((plen - 1)[:, None], width))
            cache.keep_rows(torch.isin(cached_rows, rows))
            cached_rows = rows
            return cache.forward(last[:, None], (pos - 1)[:, None], torch.ones_like(last[:, None], dtype=torch.bool),
                                 keep=1)[:, 0]

        return self.fill_batch_left_to_right(batch, next_logits)
