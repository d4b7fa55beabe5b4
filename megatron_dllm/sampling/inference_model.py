"""InferenceModel: what the samplers and evaluations know of a model (loading.py builds it from a
checkpoint or an export; an export's `generate` builds it from itself)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class InferenceModel:
    model: torch.nn.Module  # DLLMForMaskedLM (mdlm, duo, esolm, bd3lm) or DLLMForCausalLM (ar), eval mode
    family: str
    mask_id: int
    vocab_size: int         # real vocabulary including [MASK]
    seq_length: int         # the training context (max_position_embeddings)
    tokenizer: object       # megatron_dllm tokenizer (tokenize/detokenize/eod) or None
    source: str             # "megatron" | "hf"
    tokenizer_config: object = None  # the TokenizerConfig that built `tokenizer` (None: an HF directory's)
    family_options: dict = None      # the family's own settings (BD3-LM: block_size, noise), get_family's

    def compile(self, **options) -> "InferenceModel":
        """The same weights behind `torch.compile` (TorchInductor): each layer's elementwise work
        (norms, adaLN modulation, rotary, GELU, residual adds) fused into a few kernels. At batch 1
        a forward is some fifty kernels a layer, and on a GPU even a graph-replayed kernel costs a
        few microseconds, so fusing them matters as much as the matmuls. A shape is compiled when
        first met, and a second size of a dimension (a prompt's length, a KV cache's) compiles it
        once more as dynamic; `--cuda-graphs` captures the compiled forward. `options`:
        torch.compile's (backend, mode, ...)."""
        return dataclasses.replace(self, model=torch.compile(self.model, **options))

    def make_family(self):
        """The `families.Family` this model was trained as."""
        from .deps import get_family

        return get_family(self.family, self.mask_id, self.vocab_size, **(self.family_options or {}))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
