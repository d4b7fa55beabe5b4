"""BD3-LM semi-autoregressive sampler: left to right over blocks, diffusion inside a block.

As in BD3-LM's public code (`_semi_ar_sampler`): blocks sit at the training positions
[kB, (k + 1)B); a block whose start lies inside the prompt keeps the prompt tokens as clean tokens
of its noised copy. Each block is denoised by the in-block family's own ancestral rule, with --steps
steps per block, through that family's batched block loop (`sample_batch`):

    --noise mask     MDLM's ancestral step with its no-change cache and greedy final step
                     (`MDLMSampler.sample_batch`);
    --noise uniform  Duo's exact posterior and greedy tail (`DuoSampler.sample_batch`), starting
                     from uniform ids; the model gets sigma = 0 (BD3-LM is not time-conditioned).

What BD3-LM changes is where a block's logits come from (`batch_blocks`, `CommittedBlocks`): a
block attends to itself and to the clean blocks before it, which never change once committed, so
their keys and values are cached exactly. Each denoising call runs only the B tokens of the
current block over the cache (kv_keep = 0: nothing noisy is stored) and a finished block is
committed by one more call on its clean tokens (without the output layer). Without the cache
(`--no-kv-cache`) every call recomputes the clean prefix and the block under the block-causal
layout, which gives the same logits: the cache changes the cost, not the result.

Batches (`sample_batch`, and `sample`, which runs its rows through it): rows may have prompts and
canvases of different lengths. Blocks sit at the same positions in every row, so all rows decode
the block [start, start + B) together; a row whose prompt still covers the block only commits it,
a row whose canvas ends inside it decodes the shorter block (its padding is a key-padding mask,
never attended), and every draw of a row comes from its own generator in the order and shape of
its batch-1 run, so row i is the batch-1 sample of prompt i with generator i.

`--predictor left-to-right` (the GSM8K protocol): the same blocks and cache, one position per
model call in sequence order, drawn from the block's logits at that position (the rest of the
block still [MASK] or noise); a row stops at its EOS.

Variable length: the canvas ends at the prompt plus --max-new-tokens (default: the model's
context); with stop-at-EOS a row is finished at its first EOS (everything after it becomes EOS)
and leaves the batch, and its cache rows, after that block.
"""
from __future__ import annotations

import torch

from .base import Sampler
from .blocks import end_at_eos
from .deps import InputError, KVCache
from .duo import DuoSampler
from .mdlm import MDLMSampler
from .positions import block_columns, flat_positions


class CommittedBlocks:
    """The denoiser of a batch's current block: logits of each row's block given the clean blocks
    before it, from their exact KV cache (`cached`) or by recomputing prefix + block. x [b, W] (the
    sampler updates it in place) and real [b, W] (each row's canvas) are the batch's."""

    def __init__(self, model, block_size: int, x: torch.Tensor, real: torch.Tensor, cached: bool):
        self.model, self.block, self.x, self.real = model, block_size, x, real
        self.kv = KVCache(model.config.num_layers, x.shape[1]) if cached else None
        self.rows = list(range(x.shape[0]))  # the batch rows still decoding (the cache's rows, in order)
        self.start = 0  # every row in `rows` is clean and real before it (committed)

    def mask(self, rows: list[int], lo: int, hi: int) -> torch.Tensor:
        """[n, hi - lo, hi] bool: queries at positions lo..hi-1 over keys 0..hi-1, the block-causal
        layout (a key in the query's block or an earlier one) minus padding; a query sees itself."""
        q = torch.arange(lo, hi, device=self.x.device)[:, None]
        k = torch.arange(hi, device=self.x.device)[None, :]
        layout = (k // self.block <= q // self.block) & self.real[rows][:, None, :hi]
        return layout | (k == q)

    def positions(self, rows: list[int], lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=self.x.device).expand(len(rows), hi - lo)

    def logits(self, rows: list[int], span: dict[int, tuple[int, int]], sigma=None, at: dict | None = None) -> dict:
        """{r: logits [hi - lo, V]} at the positions (lo, hi) = span[r] of each batch row r in `rows`
        (a subset of `self.rows`, in order), their block starting at `self.start`; given `at` ({r:
        positions in the block}), only those. The output layer runs only there. `sigma` (Duo's time
        input) is ignored: BD3-LM is not time-conditioned."""
        hi = max(span[r][1] for r in rows)
        if self.kv is None:  # recompute: the block-causal layout over prefix + block
            first, cache = 0, None
        else:  # the rows asked for run over their cached prefix (a copy when not all rows run)
            first = self.start
            cache = self.kv if rows == self.rows else self.kv.rows([self.rows.index(r) for r in rows])
        columns = [block_columns(span[r], first, (at or {}).get(r), self.x.device) for r in rows]
        out = self.model(input_ids=self.x[rows, first:hi], position_ids=self.positions(rows, first, hi),
                         attention_mask=self.mask(rows, first, hi), kv_cache=cache, kv_keep=0,  # keeps nothing
                         logits_at=flat_positions(columns, hi - first)).logits
        return dict(zip(rows, out.split([len(c) for c in columns])))

    def commit(self, rows: list[int], end: int) -> None:
        """Only the batch rows `rows` go on; their clean tokens [start, end) join the cache."""
        if self.kv is not None and rows != self.rows:
            self.kv = self.kv.rows([self.rows.index(r) for r in rows])
        self.rows = rows
        if self.kv is not None and rows and end > self.start:  # whole real blocks: the default layout
            self.model(input_ids=self.x[rows, self.start:end], position_ids=self.positions(rows, self.start, end),
                       kv_cache=self.kv, kv_keep=end - self.start, logits_at=slice(0, 0))
        self.start = end


class BD3LMSampler(Sampler):
    """The family's sampler; constructing it gives the subclass of the model's in-block noise."""

    predictors = ("ancestral", "left-to-right")
    block_wise = False  # MDLM/Duo's --block-length and approximate caches: BD3-LM has exact blocks
    open_ended = True

    def __new__(cls, family, inf, cfg):
        if cls is BD3LMSampler:
            cls = BD3LMUniformSampler if family.noise == "uniform" else BD3LMMaskSampler
        return super().__new__(cls)

    def __init__(self, family, inf, cfg):
        if cfg.max_new_tokens is not None and cfg.seq_length is not None:  # two lengths for one canvas
            raise InputError(f"--max-new-tokens {cfg.max_new_tokens} sets the canvas (the prompt, then at most that "
                             f"many tokens); give it without --seq-length {cfg.seq_length}")
        super().__init__(family.inner, inf, cfg)  # inside a block: the in-block family's schedule and ids
        self.block = family.block_size

    def canvas_length(self, prompt_length: int) -> int:
        if self.cfg.max_new_tokens is None:
            return self.length
        length = prompt_length + self.cfg.max_new_tokens
        if length > self.inf.seq_length:
            raise InputError(f"--max-new-tokens {self.cfg.max_new_tokens} after a prompt of {prompt_length} "
                             f"tokens exceeds the model's context {self.inf.seq_length}")
        return length

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[b, length]: the prompt, then the generated blocks (EOS after a row's first EOS when stopping)."""
        return self.sample_rows(prompt, generator, self.canvas_length(prompt.shape[1]))

    def sample_batch(self, batch) -> list[list[int]]:
        if self.cfg.predictor != "left-to-right":  # the in-block family's batched ancestral loop
            return super().sample_batch(batch)
        x, real = batch.canvas(self.filler(batch))
        stop_at_eos = self.cfg.stop_at_eos and self.eos_id is not None
        for rows, span, blocks in self.batch_blocks(batch, x, real):
            at = {r: span[r][0] for r in rows}  # each row's next position in the block
            while rows:  # one position per row and model call, drawn from the block's logits there
                logits = blocks.logits(rows, span, at={r: torch.tensor([at[r] - span[r][0]], device=x.device)
                                                       for r in rows})
                for r in rows:
                    x[r, at[r]] = self.draw(logits[r][None], batch.generators[r])[0]
                    at[r] += 1
                rows = [r for r in rows if at[r] < span[r][1] and not (stop_at_eos and x[r, at[r] - 1] == self.eos_id)]
        return [x[r, p:n].tolist() for r, (p, n) in enumerate(zip(batch.prompt_lengths().tolist(), batch.lengths))]

    def batch_blocks(self, batch, x: torch.Tensor, real: torch.Tensor):
        """Yields, block after block, (rows, span, denoiser): the rows generating in the block, their
        positions (lo, hi) to generate, and the `CommittedBlocks` over the clean blocks before it.
        Once the caller has decoded the block, rows that ended (canvas end, or an EOS with
        stop_at_eos) leave and the others commit it."""
        plen = batch.prompt_lengths().tolist()
        first = [p // self.block * self.block for p in plen]  # the block of each row's first new token
        blocks = CommittedBlocks(self.model, self.block, x, real, self.cfg.kv_cache)
        start = min(first)
        blocks.commit(blocks.rows, start)  # the prompts' whole blocks before any row generates
        while blocks.rows:
            end = start + self.block
            rows = [r for r in blocks.rows if first[r] <= start]  # the others' prompts cover this block
            span = {r: (max(start, plen[r]), min(end, batch.lengths[r])) for r in rows}
            if rows:
                yield rows, span, blocks
            ended = {r for r in rows if self.cfg.stop_at_eos
                     and end_at_eos(x, r, *span[r], batch.lengths[r], self.eos_id)}
            blocks.commit([r for r in blocks.rows if r not in ended and batch.lengths[r] > end], end)
            start = end


class BD3LMMaskSampler(BD3LMSampler, MDLMSampler):
    """--noise mask: MDLM's ancestral block loop over BD3-LM's blocks."""

    def filler(self, batch) -> int:
        return self.mask_id


class BD3LMUniformSampler(BD3LMSampler, DuoSampler):
    """--noise uniform: Duo's posterior block loop over BD3-LM's blocks."""

    def filler(self, batch) -> list[torch.Tensor]:
        return self.uniform_prior(batch)
