"""Generative perplexity of samples under a judge causal LM (as in the paper's code, Gen PPL).

Samples are scored as text: each is re-tokenised by the judge's tokenizer (its default special
tokens), truncated to `max_length` judge tokens (evaluate.py: the samples' length L, as the paper's
code) and to the judge's context, batched (right padding plus an attention mask), and
scored with CE(logits[:-1], ids[1:]). The figure is the token-weighted mean NLL over all samples,
exponentiated: exp(Σ nll / Σ scored tokens), not a mean of per-sample perplexities.

A sample's text is the whole L-token sample with its EOD tokens dropped (`sampling.decode`, as
the paper's code decodes it), not only its first document, so every token the model generated is
judged; `tools/sample.py --cut-at-eod` gives the earlier first-document texts.

Which tokens count (first-EOS handling, as mdlm/duo's `compute_generative_perplexity`): every
non-EOS token plus the *first* EOS of a sample; later EOS tokens are not scored (a sample that
ends its text and pads with EOS is charged once for ending, not for every pad). Two deliberate
details:
- padding never counts, whatever its id. The reference pads with EOS, so there the first pad of
  a sample shorter than its batch's longest counts as "the first EOS" and the score depends on
  batch composition; here it does not (batches are also sorted by length to cut padding).
- SD scores by the attention mask only, i.e. every real token including all EOS; with a judge
  that never sees an EOS inside the text the two rules agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_dllm.errors import InputError


def first_eos_mask(ids: torch.Tensor, attention_mask: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """[b, s] bool: real (non-pad) tokens that are not EOS, plus the first EOS of each row."""
    real = attention_mask.bool()
    if eos_id is None:
        return real
    eos = (ids == eos_id) & real
    first = eos & (eos.long().cumsum(-1) == 1)
    return real & (~eos | first)


@torch.no_grad()
def score_ids(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor, eos_id: int | None,
              suppress_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ nll [b] float64, scored tokens [b]) of right-padded ids [b, s] under a causal LM (which
    reads s - 1 of them: the last is only a target)."""
    if ids.shape[1] < 2:  # a batch of empty or one-token texts: nothing to score
        return torch.zeros(len(ids), dtype=torch.float64, device=ids.device), torch.zeros(
            len(ids), dtype=torch.long, device=ids.device)
    logits = model(input_ids=ids[:, :-1], attention_mask=attention_mask[:, :-1]).logits.float()
    if suppress_ids:
        logits[..., list(suppress_ids)] = float("-inf")
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    counted = first_eos_mask(ids, attention_mask, eos_id)[:, 1:]
    return (nll.double() * counted).sum(1), counted.sum(1)


@dataclass
class GenPPLResult:
    gen_ppl: float
    nll: float               # token-weighted mean NLL (nats)
    tokens: int              # scored judge tokens
    truncated: int           # samples cut to the judge's context
    per_sample_nll: list[float]  # Σ nll / scored tokens of each sample (None for nothing scored)


def generative_perplexity(judge, texts: Sequence[str], batch_size: int = 8,
                          max_length: int | None = None) -> GenPPLResult:
    """Gen PPL of `texts` under `judge` (evaluation.judge.Judge)."""
    if batch_size < 1:
        raise InputError(f"--batch-size {batch_size}: expected a positive number")
    limit = min(judge.context, max_length) if max_length else judge.context
    encoded = [judge.tokenizer(t)["input_ids"] for t in texts]
    truncated = sum(len(e) > limit for e in encoded)
    encoded = [e[:limit] for e in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    device = next(judge.model.parameters()).device
    sums = torch.zeros(len(texts), dtype=torch.float64)
    counts = torch.zeros(len(texts), dtype=torch.int64)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(1, max(len(encoded[i]) for i in rows))
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for r, i in enumerate(rows):
            ids[r, :len(encoded[i])] = torch.tensor(encoded[i], dtype=torch.int64)
            mask[r, :len(encoded[i])] = 1
        s, c = score_ids(judge.model, ids.to(device), mask.to(device), judge.eos_id, judge.suppress_ids)
        sums[rows], counts[rows] = s.cpu(), c.cpu()
    total = int(counts.sum())
    if total == 0:
        raise InputError("no token to score: every sample is shorter than two judge tokens")
    nll = float(sums.sum() / total)
    per_sample = [float(s / c) if c else None for s, c in zip(sums, counts)]
    return GenPPLResult(float(torch.tensor(nll, dtype=torch.float64).exp()), nll, total, truncated, per_sample)
