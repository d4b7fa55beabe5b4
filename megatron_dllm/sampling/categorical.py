"""Categorical sampling shared by every sampler (the paper's code's "Categorical sampling", in the
same distribution).

Sampling runs in float64 by default: float32 noise truncates the tail of the distribution, which
lowers entropy and gen-PPL artificially (facebookresearch/flow_matching#27). The paper's code
draws by an exponential race, argmax(p / E) with E = -log U ~ Exp(1) (Gumbel-argmax in
probability space): one uniform drawn and logged per id. In float64 `sample` inverts the
cumulative sum at one uniform per row instead (`sample_by_cdf`), the same distribution at a
fraction of the cost; in float32 (`--no-float64`) it keeps the race, whose truncated noise is what
that setting exists to show. Neither needs p normalised. Samplers draw from logits through
`draw`, which forms the float64 distribution a chunk of rows at a time (`row_chunks`) unless its
nucleus is one id (then the argmax, its uniforms drawn all the same), and take greedy ids through
`greedy`, which forms none; `draw` reaches `probabilities` through this module's namespace, so a
test can watch which dtype reaches it.
"""
from __future__ import annotations

import torch

# The float64 rows `draw` works on at once, in bytes. On a CPU, 8 MiB stays in cache and in
# malloc's reused heap; a fresh buffer of 32 MiB or more is mapped anew and its pages faulted in,
# and at V = 32,001 the draw took 3x as long. On a GPU each chunk costs a few kernel launches, so
# a chunk is large and only bounds the step's memory. (The sampler files ship in HF exports
# without megatron_dllm's platform module, so the device's rule is here.)
CHUNK_BYTES = {"cpu": 8 << 20}
GPU_CHUNK_BYTES = 1 << 30


def precision(float64: bool) -> torch.dtype:
    return torch.float64 if float64 else torch.float32


def probabilities(logits: torch.Tensor, dtype: torch.dtype, temperature: float = 1.0,
                  top_p: float = 1.0, suppress: int | None = None) -> torch.Tensor:
    """softmax(logits / temperature) in `dtype` over the last dim, id `suppress` ([MASK]) at
    probability 0, restricted to the top-p nucleus and renormalised. One copy of the logits in
    `dtype`, worked on in place and returned: at a sampler's [positions, V] in float64 that buffer
    is 8 bytes a logit, and a second one (softmax's own result) would halve the batch that fits."""
    logits = logits.to(dtype, copy=True)
    if temperature != 1.0:
        logits.div_(temperature)
    if suppress is not None:
        logits[..., suppress] = float("-inf")
    probs = torch.softmax(logits, -1, out=logits)  # a row's values are read before they are written
    return nucleus(probs, top_p) if top_p < 1.0 else probs


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely ids whose mass reaches top_p (at least one id),
    renormalised, written over `probs` (the sort's order is a permutation: every entry is rewritten)."""
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1).sub_(sorted_p)  # mass of the ids ranked above each id
    sorted_p.masked_fill_(before >= top_p, 0.0)
    del before
    kept = probs.scatter_(-1, order, sorted_p)
    return kept.div_(kept.sum(-1, keepdim=True))


def draw(logits: torch.Tensor, dtype: torch.dtype, generator: torch.Generator, temperature: float = 1.0,
         top_p: float = 1.0, suppress: int | None = None, at: torch.Tensor | None = None):
    """One id per row of logits [..., V] from `probabilities(logits, dtype, temperature, top_p,
    suppress)`: the ids `sample` draws from them with `generator`. In float64 the rows go through
    `row_chunks` at a time, their uniforms drawn first as `sample` draws them, so the distribution
    is never formed over more rows than a chunk's; in float32 the race's uniform per id is drawn at
    once, as `sample` draws it. With `at` (an id per row): (ids, each row's probability of its id
    in `at`)."""
    shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    if dtype == torch.float64:
        u = torch.rand(rows.shape[0], generator=generator, dtype=dtype, device=rows.device)
        chunks = row_chunks(*rows.shape, dtype, rows.device)
        if one_id(top_p, rows.shape[-1]):  # greedy: the draw is the argmax, its uniforms drawn all the same
            ids = greedy(rows, suppress)
            return ids.view(shape) if at is None else (ids.view(shape), (ids == at.reshape(-1)).to(dtype).view(shape))
    else:
        chunks = [slice(None)]
    ids, p_at = [], []
    for chunk in chunks:
        probs = probabilities(rows[chunk], dtype, temperature, top_p, suppress)
        if at is not None:
            p_at.append(probs.gather(-1, at.reshape(-1, 1)[chunk])[:, 0])
        ids.append(sample_by_cdf(probs, u[chunk]) if dtype == torch.float64 else sample(probs, generator))
        del probs  # before the next chunk's is made
    ids = joined(ids).view(shape)
    return ids if at is None else (ids, joined(p_at).view(shape))


def one_id(top_p: float, vocab: int) -> bool:
    """Whether the top-p nucleus is the most likely id alone in every row: it holds at least 1/V of
    the mass, which reaches a top-p this small (greedy decoding's vanishing top-p)."""
    return top_p * vocab <= 0.5


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' results as one tensor; a single chunk's as it is (no copy: a kernel less per
    step on a GPU, where batch-1 steps are launch-bound)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def greedy(logits: torch.Tensor, suppress: int | None = None) -> torch.Tensor:
    """The most likely id per row of logits [..., V], `suppress` excluded: the argmax of
    `probabilities(logits, ...)` at any temperature and top-p (the softmax keeps the ids' order,
    the nucleus the most likely one) without forming them, from two views of the logits. A tie
    goes to the lower id, as argmax's do."""
    if suppress is None:
        return logits.argmax(-1)
    below, above = logits[..., :suppress], logits[..., suppress + 1:]
    if not above.shape[-1]:
        return below.argmax(-1)
    if not below.shape[-1]:
        return above.argmax(-1) + suppress + 1
    low, high = below.max(-1), above.max(-1)
    return torch.where(low.values >= high.values, low.indices, high.indices + suppress + 1)


def row_chunks(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> list[slice]:
    """The rows of a [rows, vocab] distribution in `dtype`, in slices of about `CHUNK_BYTES` (one,
    empty, for no rows)."""
    step = max(1, CHUNK_BYTES.get(device.type, GPU_CHUNK_BYTES) // (vocab * dtype.itemsize))
    return [slice(i, i + step) for i in range(0, max(rows, 1), step)]


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id per row of (unnormalised) probs, which it consumes: in float64 by inverting the
    cumulative sum (`sample_by_cdf`) at one uniform per row from `generator`, written over probs;
    in float32 the paper's race argmax(p / (1e-10 - log(U + 1e-10))), in one buffer of probs' size
    (1e-10 - a is -a + 1e-10 bit for bit)."""
    if probs.dtype == torch.float64:
        return sample_by_cdf(probs, torch.rand(probs.shape[:-1], generator=generator, dtype=probs.dtype,
                                               device=probs.device))
    race = torch.rand(probs.shape, generator=generator, dtype=probs.dtype, device=probs.device)
    race.add_(1e-10).log_().neg_().add_(1e-10)
    return torch.div(probs, race, out=race).argmax(-1)


def sample_by_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One id per row of (unnormalised) probs: where its cumulative sum first reaches (1 - u) times
    the row's total, for uniforms u in [0, 1) of the rows' shape. The target lies in (0, total], so
    an id of probability 0 is never drawn. Works `probs` into its cumulative sum in place."""
    cdf = probs.cumsum_(-1)
    target = torch.sub(1, u).mul_(cdf[..., -1])
    return torch.searchsorted(cdf, target[..., None])[..., 0]
