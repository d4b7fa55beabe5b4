"""Dream's shift ("Dream 7B", its `generation_utils.py`) for an MDLM adapted from an AR model
(`--shift`): the logits at position i - 1 predict token i, so the AR head keeps its meaning;
position 0, which nothing precedes, keeps its own logits.

The one implementation of the shift: MDLM's loss and bound (families/mdlm.py: training,
validation, `tools/evaluate.py nelbo`, lm-eval likelihoods) and every sampler
(sampling/shifted_model.py) apply it, so a model samples and is evaluated as it was trained. Torch only:
HF exports ship this file flat beside their sampler files (hf/remote_code.py).
"""
from __future__ import annotations

import torch


def shift_right(logits: torch.Tensor, dim: int) -> torch.Tensor:
    """`logits` with position i holding the logits of i - 1 along the sequence axis `dim`, and
    position 0 its own."""
    length = logits.shape[dim]
    return torch.cat([logits.narrow(dim, 0, 1), logits.narrow(dim, 0, length - 1)], dim=dim)
