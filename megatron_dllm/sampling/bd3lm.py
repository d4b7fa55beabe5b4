"""BD3-LM semi-autoregressive sampler: left to right over blocks, diffusion inside a block.

As in BD3-LM's public code (`_semi_ar_sampler`): blocks sit at the training positions
[kB, (k + 1)B); a block whose start lies inside the prompt keeps the prompt tokens as clean tokens
of its noised copy. Each block is denoised by the in-block family's own ancestral rule, with --steps
steps per block:

    --noise mask     MDLM's ancestral step with its no-change cache and greedy final step
                     (`sampling/mdlm.ancestral`);
    --noise uniform  Duo's exact posterior and greedy tail (`sampling/duo.ancestral`), starting
                     from uniform ids; the model gets sigma = 0 (BD3-LM is not time-conditioned).

A block attends to itself and to the clean blocks before it, which never change once committed,
so their keys and values are cached exactly (`kv_cache`, the dense model's `KVCache`): each
denoising call runs the B tokens of the current block over the cache (kv_keep = 0: nothing noisy
is stored) and a finished block is committed by one more call on its clean tokens. Without the
cache every call recomputes the clean prefix and the block under the block-causal layout, which
gives the same logits: `--kv-cache` changes the cost, not the result.

Variable length: the canvas ends at the prompt plus --max-new-tokens (default: the model's
context); with stop-at-EOS a row is finished at its first EOS (everything after it becomes EOS)
and decoding stops after the block in which every row has finished.
"""
from __future__ import annotations

import torch

from .base import Sampler
from .deps import InputError, KVCache
from .duo import ancestral as duo_ancestral
from .duo import uniform_ids
from .mdlm import ancestral as mdlm_ancestral


class BD3LMSampler(Sampler):
    predictors = ("ancestral",)

    def __init__(self, family, inf, cfg):
        super().__init__(family, inf, cfg)
        self.block = family.block_size
        self.uniform = family.noise == "uniform"

    def canvas_length(self, prompt_length: int) -> int:
        if self.cfg.max_new_tokens is None:
            return self.length
        length = prompt_length + self.cfg.max_new_tokens
        if length > self.inf.seq_length:
            raise InputError(f"--max-new-tokens {self.cfg.max_new_tokens} after a prompt of {prompt_length} "
                             f"tokens exceeds the model's context {self.inf.seq_length}")
        return length

    def block_logits(self, x: torch.Tensor, start: int, end: int, cache) -> torch.Tensor:
        """Logits [b, end - start, V] of the block x[:, start:end] over the clean x[:, :start]."""
        if cache is None:  # recompute: the model's block-causal layout over prefix + block
            return self.model(input_ids=x[:, :end], position_ids=self.positions(x, 0, end)).logits[:, start:]
        return self.model(input_ids=x[:, start:end], position_ids=self.positions(x, start, end),
                          kv_cache=cache, kv_keep=0).logits

    def commit(self, x: torch.Tensor, start: int, end: int, cache) -> None:
        """Store the keys and values of the clean tokens x[:, start:end] (an exact cache entry)."""
        if cache is not None and end > start:
            self.model(input_ids=x[:, start:end], position_ids=self.positions(x, start, end), kv_cache=cache,
                       kv_keep=end - start)

    @staticmethod
    def positions(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=x.device).expand(x.shape[0], end - start)

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.generate(prompt, generator, self.canvas_length(prompt.shape[1]))

    def generate(self, prompt: torch.Tensor, generator: torch.Generator, length: int) -> torch.Tensor:
        """[b, length]: the prompt, then the generated blocks (EOS after a row's first EOS when stopping)."""
        b, p = prompt.shape
        x = torch.full((b, length), self.mask_id, dtype=torch.long, device=prompt.device)
        x[:, :p] = prompt
        if self.uniform:  # the uniform prior, drawn once for the whole canvas
            x[:, p:] = uniform_ids(b, length - p, self.family.inner.num_real, self.mask_id, generator, x.device)
        cache = KVCache(self.model.config.num_layers, length) if self.cfg.kv_cache else None
        first = p // self.block * self.block  # the block that holds the first generated position
        self.commit(x, 0, first, cache)
        finished = torch.zeros(b, dtype=torch.bool, device=x.device)
        stop = self.cfg.stop_at_eos and self.eos_id is not None
        for start in range(first, length, self.block):
            end, lo = min(start + self.block, length), max(start, p)
            self.denoise_block(x, start, end, lo, cache, generator)
            if stop:
                eos = x[:, lo:end] == self.eos_id
                after = (eos.cumsum(1) - eos.long()) > 0  # strictly after the row's first EOS here
                x[:, lo:end] = torch.where(finished[:, None] | after, self.eos_id, x[:, lo:end])
                finished |= eos.any(1)
                if bool(finished.all()):
                    x[:, end:] = self.eos_id
                    break
            if end < length:
                self.commit(x, start, end, cache)
        return x

    def denoise_block(self, x, start: int, end: int, lo: int, cache, generator) -> None:
        """Generate x[:, lo:end] in place, the block x[:, start:end] attending to the clean prefix."""
        block = x[:, start:end]  # a view: the in-block samplers write through to x
        if self.uniform:
            duo_ancestral(self, block, lo - start,
                          lambda _, alpha: self.block_logits(x, start, end, cache)[:, lo - start:],
                          generator, self.family.inner.num_real)
        else:
            mdlm_ancestral(self, block,
                           lambda _, masked: self.probs(self.block_logits(x, start, end, cache)[masked]),
                           generator)

    def sample_batch(self, batch) -> list[list[int]]:
        """Row by row (prompts of different lengths start their blocks at different places): row i
        is `sample` on prompt i with row i's generator, cut at its canvas length (and first EOS)."""
        out = []
        for prompt, length, gen in zip(batch.prompts, batch.lengths, batch.generators):
            row = self.generate(torch.tensor([prompt], dtype=torch.long, device=batch.device), gen, length)
            ids = row[0, len(prompt):].tolist()
            if self.cfg.stop_at_eos and self.eos_id in ids:
                ids = ids[:ids.index(self.eos_id) + 1]
            out.append(ids)
        return out
