"""Block-wise (semi-autoregressive) decoding, as in LLaDA and Fast-dLLM: the positions to generate
are cut into consecutive blocks that are decoded one after the other, each completely before the
next starts (positions after the current block stay [MASK] / noise). A row whose finished blocks
hold an EOS stops there (`stop_at_eos`): nothing after it can change the text before it.

Shared by the block-wise samplers (MDLM and Duo ancestral, `SamplingConfig.block_length`; the
remasking samplers take their blocks from `block_spans` too); the approximate KV caches
(`approx_kv_cache.py`) refresh at each block boundary.
"""
from __future__ import annotations

import torch


def block_spans(start: int, end: int, block_length: int | None) -> list[tuple[int, int]]:
    """[start, end) cut into consecutive (lo, hi) blocks of `block_length` positions (the last may
    be shorter); one block when `block_length` is None."""
    size = block_length or max(end - start, 1)
    return [(lo, min(lo + size, end)) for lo in range(start, end, size)]


def each_block(spans: list[list[tuple[int, int]]], ended: list[bool]):
    """(k, rows) for k = 0, 1, ...: the batch rows that have a k-th block and have not ended
    (`ended` is read afresh before every block)."""
    for k in range(max(len(s) for s in spans)):
        rows = [r for r, s in enumerate(spans) if k < len(s) and not ended[r]]
        if not rows:
            return
        yield k, rows


def end_at_eos(x: torch.Tensor, row: int, start: int, stop: int, length: int, eos_id: int | None) -> bool:
    """True when x[row, start:stop] (decoded) holds EOS: the row's canvas after its first EOS, up to
    `length`, becomes EOS (as left-to-right stopping fills it) and the row is done."""
    if eos_id is None:
        return False
    hits = (x[row, start:stop] == eos_id).nonzero()
    if not len(hits):
        return False
    x[row, start + int(hits[0, 0]) + 1:length] = eos_id
    return True
