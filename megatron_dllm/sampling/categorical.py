"""Categorical sampling shared by every sampler (the paper's code's "Categorical sampling", in the
same distribution).

Sampling runs in float64 by default: float32 noise truncates the tail of the distribution, which
lowers entropy and gen-PPL artificially (facebookresearch/flow_matching#27). The paper's code
draws by an exponential race, argmax(p / E) with E = -log U ~ Exp(1) (Gumbel-argmax in
probability space): one uniform drawn and logged per id. In float64 `sample` inverts the
cumulative sum at one uniform per row instead (`sample_by_cdf`), the same distribution at a
fraction of the cost; in float32 (`--no-float64`) it keeps the race, whose truncated noise is what
that setting exists to show. Neither needs p normalised. Samplers call `sample` through this
module, so a test can watch which dtype reaches it.
"""
from __future__ import annotations

import torch


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
