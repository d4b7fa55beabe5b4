"""Flat positions for a model's `logits_at`, so that its output layer runs only where a sampler draws."""
from __future__ import annotations

import torch


def flat_positions(columns, width: int) -> torch.Tensor:
    """The flat positions, in a [rows, width] model input, of each row's `columns` (a tensor [rows, n],
    or a list with one 1-d tensor per row, empty for a row with none). A tensor rather than a
    slice wherever the positions change from call to call: a compiled model specialises its graph
    on a slice's bounds, and only on a tensor's shape."""
    if isinstance(columns, torch.Tensor):
        return (torch.arange(len(columns), device=columns.device)[:, None] * width + columns).flatten()
    return torch.cat([j * width + c for j, c in enumerate(columns)])


def block_columns(span: tuple[int, int], first: int, at: torch.Tensor | None, device) -> torch.Tensor:
    """The columns of a block's positions span = (lo, hi) in an input that starts at position
    `first`: all of them, or those at the block offsets `at`."""
    lo, hi = span
    return lo - first + (torch.arange(hi - lo, device=device) if at is None else at)
