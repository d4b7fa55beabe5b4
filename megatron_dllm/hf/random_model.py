"""A dense model with random weights, for tests and benchmarks that need logits which differ from
token to token (the default initialisation's are nearly uniform): every weight but the norms'
drawn from N(0, scale^2); [MASK] is the last id."""
from __future__ import annotations

import torch

from megatron_dllm.families import FAMILIES
from megatron_dllm.hf.configuration_dllm import DLLMConfig
from megatron_dllm.hf.export import model_class


def random_dense_model(family: str, vocab_size: int, length: int, *, hidden_size: int = 32, num_layers: int = 2,
                       num_heads: int = 2, cond_dim: int = 16, scale: float = 0.2, seed: int = 0, **config):
    """The family's HF model class (eval mode) at this shape; `config`: further DLLMConfig fields."""
    config = DLLMConfig(family=family, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        vocab_size=vocab_size, mask_token_id=vocab_size - 1, cond_dim=cond_dim,
                        max_position_embeddings=length, attention=FAMILIES[family].attention, **config)
    torch.manual_seed(seed)
    model = model_class(family)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn_like(param) * scale)
    return model.eval()
