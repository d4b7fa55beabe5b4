"""A batch of prompts of different lengths for conditional generation, one random stream per row.

Row i is prompt_i followed by the positions to generate, up to its own canvas length L_i (the
length a batch-1 run with that prompt uses), padded on the right to the longest row with
`pad_id`; `real` marks what is not padding. Padding is never attended (diffusion families pass
`real` as the key-padding mask, causal ones keep it in `PaddedKVCache`), and every random draw
of row i comes from row i's own generator, in the order and shape a batch-1 run draws it. Row i
of a batch is therefore the batch-1 sample with row i's seed: the same tokens, not a
statistically equal sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptBatch:
    prompts: list[list[int]]
    lengths: list[int]                  # canvas length L_i per row: prompt + the positions to generate
    generators: list[torch.Generator]   # one per row, seeded as the batch-1 run of that row
    device: torch.device
    pad_id: int = 0                     # any id: padding changes no result

    @property
    def size(self) -> int:
        return len(self.prompts)

    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.prompts], device=self.device)

    def canvas_lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths, device=self.device)

    def canvas(self, fillers: list[torch.Tensor] | int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [b, max L_i]: prompt_i, then fillers[i] (or one id) up to L_i, then padding; real [b, max L_i])."""
        width = max(self.lengths)
        x = torch.full((self.size, width), self.pad_id, dtype=torch.long, device=self.device)
        for i, (prompt, length) in enumerate(zip(self.prompts, self.lengths)):
            x[i, :len(prompt)] = torch.as_tensor(prompt, device=self.device)
            x[i, len(prompt):length] = fillers if isinstance(fillers, int) else fillers[i]
        real = torch.arange(width, device=self.device)[None] < self.canvas_lengths()[:, None]
        return x, real
