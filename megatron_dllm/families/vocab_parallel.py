"""Loss primitives on logits [s, b, V/tp] sharded over the vocabulary across tensor-parallel ranks.

Nothing here gathers the full logits: reductions over the vocabulary are tensor-parallel
all-reduces of per-token vectors. The columns no token can take ([MASK], the TP padding) are
left out inside the losses, never set to -inf on the autograd-tracked logits: autograd would then
clone the whole logits gradient.

`cross_entropy` needs no memory beyond the logits but fp32 row chunks: its forward overwrites the
logits with exp(l - max), in their dtype, and its backward scales those into the gradient in
place. Megatron-core's `vocab_parallel_cross_entropy` keeps an fp32 softmax (twice the bf16
logits) and returns an fp32 gradient that autograd casts back to bf16.

Compiled heads. The vocabulary-sized work of a head is a loop over row chunks whose bodies are
functions of the chunk alone that write their results in place (the cross entropy's
`_exp_sum_masked_` here, Duo's in `duo.py`). Inside `compiled_heads()` (the training step under
`--compile-elementwise`) each body runs `torch.compile`d, as one fused kernel in place of up to ten
operations (each a pass over the chunk's fp32 copy and on a GPU a launch). A compiled body keeps
no temporaries, so it takes all rows at once. The heads pick eager or compiled in their forward
and keep the choice for their backward, which autograd runs after the context has closed.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

# elements of each fp32 row chunk of the cross entropy over bf16 logits: 64 MiB, about 10
# operations a chunk eagerly (each a kernel launch on a GPU; 16 chunks for a micro-batch of
# 4 x 2048 at V = 32,001); fp32 logits are worked whole, and compiled, one fused kernel takes all rows
CHUNK_ELEMENTS = 1 << 24

_COMPILED_HEADS = contextvars.ContextVar("compiled_heads", default=False)


@contextlib.contextmanager
def compiled_heads(enabled: bool = True):
    """The loss heads called inside run their chunk bodies compiled (`enabled`) or eagerly."""
    token = _COMPILED_HEADS.set(enabled)
    try:
        yield
    finally:
        _COMPILED_HEADS.reset(token)


def heads_compiled() -> bool:
    """Whether a head called now runs compiled (inside `compiled_heads()`)."""
    return _COMPILED_HEADS.get()


def chunk_body(fn: Callable, compiled: bool) -> Callable:
    """A head's chunk body, eager or compiled."""
    return _compile(fn) if compiled else fn


def row_chunks(rows: int, width: int, chunk_elements: int, whole: bool) -> list[slice]:
    """The row chunks a head works in: of at most `chunk_elements` (a body's fp32 temporaries are
    chunk-sized), or all rows at once where its body keeps no temporaries (`whole`: compiled, or
    working fp32 logits in place), so that chunks would only cost operations."""
    step = max(rows, 1) if whole else max(1, chunk_elements // max(width, 1))
    return [slice(r, r + step) for r in range(0, rows, step)]


@functools.cache
def _compile(fn: Callable) -> Callable:
    """`fn` compiled once per process, its shapes and column ranges symbolic from the first call
    (dynamic=True): the rows change with each micro-batch's length, and one graph takes them all
    (compiled per shape, the ninth would stop the run: fullgraph=True makes dynamo's recompile
    limit an error). A new graph comes with another dtype, another number of excluded column
    ranges, or where two sizes dynamo took for one (equal at the first call) differ."""
    return torch.compile(fn, fullgraph=True, dynamic=True)


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


def tp_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`tensor` reduced in place over the tensor-parallel group (as it is without TP)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def local_pick(logits2d: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """logits2d[row, ids[row]] for ids this shard owns, 0 elsewhere (fp32, [rows])."""
    local = ids - start
    owned = (local >= 0) & (local < logits2d.shape[1])
    picked = logits2d.gather(1, local.clamp(0, logits2d.shape[1] - 1)[:, None])[:, 0].float()
    return torch.where(owned, picked, torch.zeros_like(picked))


def fp32_chunk(rows: torch.Tensor, excluded) -> torch.Tensor:
    """An fp32 copy of rows of the logits with the excluded columns at -inf."""
    out = rows.to(torch.float32, copy=True)
    for lo, hi in excluded:
        out[:, lo:hi] = float("-inf")
    return out


def included_columns(width: int, excluded) -> list[tuple[int, int]]:
    """The [lo, hi) column ranges of a shard of `width` columns that `excluded` leaves."""
    bounds = [0, *(edge for lo, hi in sorted(excluded) for edge in (lo, hi)), width]
    return [(lo, hi) for lo, hi in zip(bounds[::2], bounds[1::2]) if lo < hi]


def column_mask(width: int, ranges, device) -> torch.Tensor:
    """A bool mask [width], true in the [lo, hi) column `ranges`."""
    mask = torch.zeros(width, dtype=torch.bool, device=device)
    for lo, hi in ranges:
        mask[lo:hi] = True
    return mask


def _exp_sum_(rest: torch.Tensor, rows: torch.Tensor, m: torch.Tensor, index: torch.Tensor, owned: torch.Tensor,
              excluded: list[tuple[int, int]]) -> None:
    """rest = Σ_{j != target} exp(l_j - m) over the real ids of each row of logits, whose storage
    takes e = exp(l - m) in its dtype (0 in the `excluded` column ranges and at an owned target).
    fp32 logits are worked on in place, others over an fp32 copy. Eager: the zeros are written
    into a few columns (a mask over the chunk would cost two more passes over it)."""
    e = rows.float().sub_(m[:, None]).exp_()
    for lo, hi in excluded:
        e[:, lo:hi] = 0.0
    e.scatter_(1, index, e.gather(1, index).masked_fill_(owned[:, None], 0.0))
    if e.dtype != rows.dtype:
        rows.copy_(e)
    rest.copy_(e.sum(1))


def _exp_sum_masked_(rest: torch.Tensor, rows: torch.Tensor, m: torch.Tensor, index: torch.Tensor,
                     owned: torch.Tensor, excluded: torch.Tensor) -> None:
    """`_exp_sum_` as one fused kernel computes it (compiled): the target and the excluded columns
    (a bool mask [width]) zeroed through one comparison, which the kernel evaluates in registers.
    A scatter would need a chunk-sized buffer, and column slices beside the comparison fail torch
    2.11's CPU compile."""
    e = rows.float().sub_(m[:, None]).exp_()
    columns = torch.arange(e.shape[1], device=e.device)
    drop = columns == index.masked_fill(~owned[:, None], -1)  # -1: a target on another shard
    e.masked_fill_(drop.logical_or_(excluded), 0.0)
    if e.dtype != rows.dtype:
        rows.copy_(e)
    rest.copy_(e.sum(1))


class _CrossEntropy(torch.autograd.Function):
    """-log softmax(l)[target] per row of vocab-parallel logits [rows, V/tp], excluded columns
    having probability 0. The logits' storage is reused: the forward overwrites it with
    e = exp(l - max) (0 in the excluded columns and at the target), the backward with the gradient
    (e / sum) g, and (p - 1) g at the target from the fp32 loss (p in bf16 would cancel there).
    fp32 logits are worked on whole and in place, lower precisions over fp32 copies of row chunks
    (compiled: all rows at once)."""

    @staticmethod
    def forward(ctx, logits2d, targets, start, excluded):
        rows, width = logits2d.shape
        compiled = heads_compiled()
        local = targets - start
        owned = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1)[:, None]
        m = torch.full((rows,), float("-inf"), device=logits2d.device)  # max over the real ids (a shard may hold none)
        for lo, hi in included_columns(width, excluded):
            torch.maximum(m, logits2d[:, lo:hi].amax(1).float(), out=m)
        tp_all_reduce(m, dist.ReduceOp.MAX)
        # Σ_{j != target} e_j and the logit at the target (0 off its shard, -inf if no token can take it)
        stats = torch.empty(2, rows, dtype=torch.float32, device=logits2d.device)
        stats[1] = local_pick(logits2d, targets, start)
        for lo, hi in excluded:
            stats[1].masked_fill_((local >= lo) & (local < hi), float("-inf"))
        if compiled:
            exp_sum_, dropped = _compile(_exp_sum_masked_), column_mask(width, excluded, logits2d.device)
        else:
            exp_sum_, dropped = _exp_sum_, excluded
        for sl in row_chunks(rows, width, CHUNK_ELEMENTS, compiled or logits2d.dtype == torch.float32):
            exp_sum_(stats[0, sl], logits2d[sl], m[sl], index[sl], owned[sl], dropped)
        tp_all_reduce(stats)
        rest, margin = stats[0], m - stats[1]  # margin = max - target logit >= 0
        # -log p = margin + log(rest + e_target), e_target = exp(-margin), as log1p: exact for a
        # confident target (margin 0, rest << 1), where log(sum) would round 1 + rest away
        loss = margin + torch.log1p(rest + torch.expm1(-margin))
        ctx.save_for_backward(logits2d, index, owned, rest + torch.exp(-margin), loss)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        e, index, owned, sum_e, loss = ctx.saved_tensors
        grad = e.mul_((grad_loss / sum_e)[:, None])
        at_target = torch.arange(len(index), device=grad.device) * grad.shape[1] + index[:, 0]  # flat positions
        value = torch.where(owned, torch.expm1(-loss) * grad_loss, grad.view(-1)[at_target].float())
        grad.view(-1)[at_target] = value.to(grad.dtype)
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask_id: int, vocab_size: int) -> torch.Tensor:
    """-log p(target) per token in fp32, p the softmax over the real ids: [MASK] and the TP padding
    (ids >= vocab_size) are never predicted and get zero gradient.

    logits: [s, b, V/tp] as the model returns them; targets [b, s]; result [b, s]. Works in place:
    `logits` holds exp(logits - max) afterwards and its gradient after the backward, so call it
    once per logits and read nothing else from them.
    """
    s, b, width = logits.shape
    start, _ = local_vocab_range(logits)
    excluded = excluded_columns(logits, mask_id, vocab_size)
    row_targets = targets.t().reshape(-1).to(logits.device)  # rows in the logits' (s, b) order
    return _CrossEntropy.apply(logits.reshape(s * b, width), row_targets, start, excluded).view(s, b).t()
