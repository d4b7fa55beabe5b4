"""InferenceModel: what the samplers and evaluations know of a model (loading.py builds it from a
checkpoint or an export; an export's `generate` builds it from itself)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InferenceModel:
    model: torch.nn.Module  # DLLMForMaskedLM (mdlm, duo, esolm) or DLLMForCausalLM (ar), eval mode
    family: str
    mask_id: int
    vocab_size: int         # real vocabulary including [MASK]
    seq_length: int         # the training context (max_position_embeddings)
    tokenizer: object       # megatron_dllm tokenizer (tokenize/detokenize/eod) or None
    source: str             # "megatron" | "hf"
    tokenizer_config: object = None  # the TokenizerConfig that built `tokenizer` (None: an HF directory's)
    family_options: dict = None      # the family's own settings (BD3-LM: block_size, noise), get_family's

    def make_family(self):
        """The `families.Family` this model was trained as."""
        from .deps import get_family

        return get_family(self.family, self.mask_id, self.vocab_size, **(self.family_options or {}))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
