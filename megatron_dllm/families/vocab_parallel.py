"""Loss primitives on logits [s, b, V/tp] sharded over the vocabulary across tensor-parallel ranks.

Nothing here gathers the full logits: reductions over the vocabulary are tensor-parallel
all-reduces inside megatron's `vocab_parallel_cross_entropy`.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def local_vocab_range(logits: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the global vocabulary ids held by this rank's shard."""
    size = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * size
    return start, start + size


def excluded_columns(logits: torch.Tensor, mask_id: int, vocab_size: int) -> list[tuple[int, int]]:
    """The local [lo, hi) column ranges of this rank's shard that are not real ids: [MASK] and the
    TP padding (ids >= vocab_size)."""
    start, end = local_vocab_range(logits)
    ranges = [(max(lo, start), min(hi, end)) for lo, hi in ((mask_id, mask_id + 1), (vocab_size, end))]
    return [(lo - start, hi - start) for lo, hi in ranges if lo < hi]


def suppress(logits: torch.Tensor, mask_id: int, vocab_size: int) -> torch.Tensor:
    """Never predict [MASK] or the TP padding ids (>= vocab_size): their logits become -inf.

    In place on this rank's shard (no logits-sized copy); autograd gives them zero gradient.
    """
    for lo, hi in excluded_columns(logits, mask_id, vocab_size):
        logits[..., lo:hi] = float("-inf")
    return logits


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[targets] per token, in fp32, over the sharded vocabulary.

    logits: [s, b, V/tp] as the model returns them; targets [b, s]; result [b, s]. Megatron's
    kernel works in place on `logits` (it holds exp(logits) afterwards): call it once per logits.
    """
    return tensor_parallel.vocab_parallel_cross_entropy(logits, targets.t().contiguous()).t()
