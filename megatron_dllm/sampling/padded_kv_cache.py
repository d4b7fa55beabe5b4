"""A KV cache for causal decoding of a batch whose rows hold different numbers of real tokens.

Every forward feeds one slice [b, s] per step in which some entries are padding (`real` False);
the K/V of the first `keep` entries of each slice are kept in the cache and `valid` records
which cached entries are real. A query attends to the real cached entries and, causally, to the
real entries of its own slice, and always to itself (a padding query must not have an empty
attention row: softmax over nothing is NaN, and NaN K/V would poison real rows at weight 0).
Padding therefore never reaches a real token. Rows can leave the batch (`keep_rows`) when they
finish, so finished rows stop costing compute.

Static by default: given `max_length` (the most entries the run caches plus its widest slice),
keys, values and `valid` are preallocated buffers written in place (`KVCache`), so a step copies
nothing; `max_length=None` grows them by concatenation (the earlier cache, kept for comparison).
"""
from __future__ import annotations

import torch

from .deps import KVCache


class PaddedKVCache:
    def __init__(self, model, rows: int, device, max_length: int | None):
        self.model = model
        self.kv = KVCache(model.config.num_layers, max_length)
        self.valid = torch.zeros(rows, max_length or 0, dtype=torch.bool, device=device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, keep: int,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, V] of the slice `ids` at rotary `positions` (or [n, V] at its flat positions
        `logits_at`); caches its first `keep` entries."""
        b, s = ids.shape
        n = len(self.kv)
        own = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril() & real[:, None, :]
        own |= torch.eye(s, dtype=torch.bool, device=ids.device)
        mask = torch.cat([self.valid[:, None, :n].expand(b, s, -1), own], dim=2)
        logits = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, kv_cache=self.kv,
                            kv_keep=keep, logits_at=logits_at).logits
        if self.kv.max_length is None:
            self.valid = torch.cat([self.valid, real[:, :keep]], dim=1)
        else:
            self.valid[:, n:n + keep] = real[:, :keep]
        return logits

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Drop the rows where the boolean `keep` [b] is False."""
        if bool(keep.all()):
            return
        self.kv = self.kv.rows(keep)
        self.valid = self.valid[keep]
