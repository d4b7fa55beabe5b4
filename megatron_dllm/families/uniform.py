"""Uniform-state noise (Duo; BD3-LM's `--noise uniform`): a token redrawn uniformly from the real
ids, every id below the vocabulary size but [MASK]. One rule for training and for the samplers;
HF exports ship this file beside their samplers, so it imports torch only.
"""
from __future__ import annotations

import torch


def num_real(mask_id: int, vocab_size: int) -> int:
    """V: the number of ids a token can take."""
    return vocab_size - (1 if 0 <= mask_id < vocab_size else 0)


def real_ids(u: torch.Tensor, mask_id: int, vocab_size: int) -> torch.Tensor:
    """Ids uniform over the real ids, one per uniform draw in `u` ([0, 1)); [MASK] is skipped."""
    count = num_real(mask_id, vocab_size)
    k = (u * count).long().clamp_(max=count - 1)
    return k + (k >= mask_id).long() if 0 <= mask_id < vocab_size else k
