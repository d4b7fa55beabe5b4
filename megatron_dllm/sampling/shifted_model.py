"""The model of a shifted MDLM (`--shift`, an MDLM adapted from an AR model) as the samplers see
it: the logits at position i are the model's at i - 1, by the shift training's loss applies
(`shift_right`, families/shift.py), so a sampler reads each position's prediction where it always
does. The model still gets the whole canvas from position 0 (the samplers' full forwards); a
window of it (an approximate KV cache's) would lack the position before its first one, so the
samplers refuse those (`Sampler.check_shift`).
"""
from __future__ import annotations

import torch

from .deps import shift_right


class ShiftedModel:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config

    def __call__(self, input_ids: torch.Tensor, logits_at: torch.Tensor | None = None, **inputs):
        if inputs.get("kv_cache") is not None or inputs.get("position_ids") is not None:
            raise ValueError("a shifted model's logits need the whole canvas from position 0")
        if isinstance(logits_at, slice):  # positions start..stop-1 of every row take start-1..stop-2
            start, stop, _ = logits_at.indices(input_ids.shape[1])
            if start > 0 or stop <= start:
                return self.model(input_ids=input_ids, logits_at=slice(max(start - 1, 0), max(stop - 1, 0)), **inputs)
            logits_at = slice(0, stop)  # position 0 keeps its own logits: shifted below, as a full forward's
        elif logits_at is not None:  # flat positions: each one's logits come from the position before it
            return self.model(input_ids=input_ids, logits_at=logits_at - (logits_at % input_ids.shape[1] > 0).long(),
                              **inputs)
        out = self.model(input_ids=input_ids, logits_at=logits_at, **inputs)
        out.logits = shift_right(out.logits, dim=1)
        return out
