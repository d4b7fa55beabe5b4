"""Approximate prefix and dual KV caches for the bidirectional families (MDLM, Duo) in block-wise
decoding, as in Fast-dLLM ("Fast-dLLM: Training-free Acceleration of Diffusion LLM by Enabling
KV Cache and Parallel Decoding").

With bidirectional attention every position's keys and values depend on the whole canvas, so a
cache of them is exact only while the canvas does not change. The first denoiser call of each
block is a full forward that writes the K/V of every position into the cache (the refresh) and
gives that step's logits; the later calls of the block run only
  - prefix: the block and everything after it (the K/V before the block are cached),
  - dual:   the block alone (the K/V before and after it are cached),
and their fresh K/V are written into the cache in place before attention reads it. The
approximation: cached positions do not see the block's new tokens until the next block's
refresh (and, for Duo, keep the time input of the refresh). `none` is the exact sampler: every
call a full forward.
"""
from __future__ import annotations

import torch

from .positions import block_columns, flat_positions

MODES = ("none", "prefix", "dual")


class CanvasKVCache:
    """K/V of every canvas position, per layer [b, heads, width + 1, head_dim]. A forward writes its
    tokens' K/V at `slots` ([b, s] canvas positions; padding goes to the scratch slot `width`, which
    no mask lets anyone attend) and attends over the whole buffer under its explicit mask."""

    def __init__(self, num_layers: int, width: int):
        self.keys, self.values = [None] * num_layers, [None] * num_layers
        self.width = width
        self.slots: torch.Tensor | None = None

    def extend(self, layer, k, v):
        if self.keys[layer] is None:
            shape = (k.shape[0], k.shape[1], self.width + 1, k.shape[3])
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
        index = self.slots[:, None, :, None].expand_as(k)
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)
        return self.keys[layer], self.values[layer]

    def advance(self, keep):  # slots are positions, not a length: nothing to count
        pass

    def keep_rows(self, keep: torch.Tensor) -> None:
        for layer in range(len(self.keys)):
            if self.keys[layer] is not None:
                self.keys[layer], self.values[layer] = self.keys[layer][keep], self.values[layer][keep]


class BlockDenoiser:
    """The denoiser's logits over each row's current block, exact (`none`) or through an
    approximate cache (`prefix`, `dual`). x [b, W] (updated in place by the sampler) and real
    [b, W] (the positions of each row's canvas) are the batch's."""

    refresh_each_step = False  # True: every call refreshes (tests: then the caches give the exact logits)

    def __init__(self, model, mode: str, x: torch.Tensor, real: torch.Tensor):
        self.model, self.mode, self.x, self.real = model, mode, x, real
        self.cache = None if mode == "none" else CanvasKVCache(model.config.num_layers, x.shape[1])
        self.rows = torch.arange(x.shape[0], device=x.device)  # the cache's rows, in order
        self.stale = True

    def start_block(self, rows: list[int]) -> None:
        """The batch rows `rows` start a block (the others are done): the next call refreshes."""
        rows = torch.tensor(rows, device=self.x.device)
        if self.cache is not None:
            self.cache.keep_rows(torch.isin(self.rows, rows))
        self.rows, self.stale = rows, True

    def logits(self, rows: list[int], span: dict[int, tuple[int, int]], sigma: float | None = None,
               at: dict | None = None) -> dict:
        """{r: logits [hi - lo, V]} over the block (lo, hi) = span[r] of each batch row r in `rows`,
        or, given `at` ({r: positions in the block}), {r: logits [len(at[r]), V]} there; the output
        layer runs only there. With a cache every row of the current block runs (the rows not asked
        for get no logits; their cache entries are rewritten with the same values)."""
        if self.cache is None:
            index = torch.tensor(rows, device=self.x.device)
            width = int(self.real[index].sum(1).max())
            columns = [block_columns(span[r], 0, (at or {}).get(r), self.x.device) for r in rows]
            out = self.model(input_ids=self.x[index, :width], sigma=sigma, attention_mask=self.real[index, :width],
                             logits_at=flat_positions(columns, width)).logits
            return dict(zip(rows, out.split([len(c) for c in columns])))
        order = self.rows.tolist()
        width = self.x.shape[1]
        lo = torch.tensor([span[r][0] for r in order], device=self.x.device)
        if self.stale or self.refresh_each_step:  # a full forward writes every position's K/V
            self.stale = False
            start, stop = torch.zeros_like(lo), torch.full_like(lo, width)
        else:
            start = lo
            stop = (torch.tensor([span[r][1] for r in order], device=lo.device) if self.mode == "dual"
                    else self.real[self.rows].sum(1))
        slots = start[:, None] + torch.arange(int((stop - start).max()), device=lo.device)
        slots = torch.where(slots < stop[:, None], slots, width)  # padding: the scratch slot
        keys = torch.cat([self.real[self.rows], torch.zeros_like(lo, dtype=torch.bool)[:, None]], 1)
        self.cache.slots = slots
        positions = slots.clamp(max=width - 1)
        columns = [block_columns(span[r], int(start[j]), (at or {}).get(r), lo.device) if r in rows
                   else lo.new_zeros(0) for j, r in enumerate(order)]
        out = self.model(input_ids=self.x[self.rows].gather(1, positions), position_ids=positions, sigma=sigma,
                         attention_mask=keys[:, None, :].expand(-1, slots.shape[1], -1), kv_cache=self.cache,
                         logits_at=flat_positions(columns, slots.shape[1])).logits
        return {r: logits for r, logits in zip(order, out.split([len(c) for c in columns])) if r in rows}
