"""Parameter counts of a preset, from the real module tree built on the meta device (no memory)."""
from __future__ import annotations

import torch

from megatron_dllm import platform
from megatron_dllm.model.builder import Architecture, transformer_config
from megatron_dllm.model.dit import DiTModel
from megatron_dllm.model.gpt import GPTBackbone, gpt_layer_spec
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.layer import dit_layer_spec
from megatron_dllm.model.presets import Preset


def count_parameters(preset: Preset, vocab_size: int, gpt: GPTShape | None = None, seq_length: int = 1) -> dict:
    """`params` and `non_embedding_params` (all parameters minus the input embedding matrix, as in
    the paper's table) for the unpadded vocabulary, of the DiT or with `gpt` the GPT backbone
    (`seq_length`: its learned absolute positions, if any). Needs no accelerator and allocates nothing."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        platform.init_distributed(1, 1)
    arch = Architecture(preset, vocab_size, seq_length=seq_length, attention="bidirectional",
                        make_vocab_size_divisible_by=1, gpt=gpt)
    config, mlp_config = transformer_config(arch)
    with torch.device("meta"):
        if gpt is None:
            model = DiTModel(config, dit_layer_spec("bidirectional"), mlp_config, vocab_size, seq_length)
        else:
            model = GPTBackbone(config, gpt, gpt_layer_spec(gpt, "bidirectional"), vocab_size, seq_length)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.embedding.word_embeddings.weight.numel()
    return {"params": params, "non_embedding_params": params - embedding}
