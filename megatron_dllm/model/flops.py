"""Training FLOPs per sequence, for TFLOP/s logging (the scaling-law conventions come later).

Counts every matmul of a DiT forward pass: per layer 24 h^2 per token (qkv 6h^2, out 2h^2, MLP
16h^2) plus attention scores and values 4 s h per token (not halved for causal masks: the kernels
here compute the full square); the output layer 2 h V per token. Training = 3 x forward.
"""
from __future__ import annotations

from megatron_dllm.model.presets import Preset


def forward_flops_per_sequence(preset: Preset, vocab_size: int, seq_length: int) -> float:
    h, layers, s = preset.hidden_size, preset.num_layers, seq_length
    per_token = layers * (24 * h * h + 4 * s * h) + 2 * h * vocab_size
    return float(per_token * s)


def train_flops_per_sequence(preset: Preset, vocab_size: int, seq_length: int) -> float:
    return 3 * forward_flops_per_sequence(preset, vocab_size, seq_length)
