"""Log-likelihoods of continuations given contexts, for every family (the lm-eval model's scores).

- AR: exact, Σ log p(continuation token | everything before it), [MASK] excluded from the
  softmax (as the AR family's NLL); float64 log-softmax; requests batched with right padding.
- MDLM, Duo, Eso-LM: a Monte-Carlo estimate of the family's own NELBO (`family.nelbo`: MDLM and
  Eso-LM the MDLM NELBO, Duo its closed form) with N noise draws per request:
  - t stratified over the N draws ((u_k + k) / N mapped to [eps, 1], `families.base.Noise`);
  - the noise is a pure function of (seed, context tokens, draw): a request scores the same
    whatever its batch, and the answer choices of one question share their draws (common random
    numbers: the noise cancels in part when lm-eval compares the choices);
  - per-draw sums and the mean accumulate in float64; the standard error pairs adjacent strata
    (`stratified_stderr`: conservative, unlike std / sqrt(N) not inflated by the spread between strata).

Two modes (`mode`):
- `conditional` (default): the context stays clean (`Family.corrupt(..., prompt=context)`) and
  only the continuation is noised; ll = -(NELBO of the continuation given the clean context),
  a lower bound on log p(continuation | context), summed over the continuation's tokens as AR's
  exact score is. The prompt is never corrupted, so the score is about the answer alone; it has
  higher variance per request (only the continuation's tokens are averaged) and conditions the
  denoiser on a partly clean sequence, which pretraining never shows it.
- `joint` (the Duo authors' lm-eval harness, `full` mode): the whole context + continuation is
  noised as in pretraining and ll = -(mean per-token NELBO of the joint sequence). It is the
  in-distribution input and averages over more tokens (lower variance), but it is a per-token
  mean over the prompt too: it is not a likelihood of the continuation, and choices differing
  in length are compared per token rather than in total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families.base import Noise, seed_for

MODES = ("conditional", "joint")


@dataclass
class Score:
    ll: float          # log-likelihood (AR: exact; diffusion: -NELBO estimate)
    stderr: float      # standard error of the estimate (0 for AR)
    greedy: bool       # AR: every continuation token is the argmax; diffusion: False (undefined)
    tokens: int        # continuation tokens scored


class LikelihoodEstimator:
    """Scores (context ids, continuation ids) pairs with the model of an `InferenceModel`."""

    def __init__(self, inference_model, num_mc_samples: int = 64, mode: str = "conditional", batch_size: int = 64,
                 seed: int = 1234):
        if mode not in MODES:
            raise InputError(f"likelihood_mode {mode!r}: expected one of {', '.join(MODES)}")
        if num_mc_samples < 1 or batch_size < 1:
            raise InputError(f"num_mc_samples {num_mc_samples} / batch_size {batch_size}: must be >= 1")
        self.inference_model, self.mode, self.seed = inference_model, mode, seed
        self.num_mc_samples, self.batch_size = num_mc_samples, batch_size
        self.family = inference_model.make_family()
        self.max_length = inference_model.seq_length

    # ------------------------------------------------------------------ public

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
        """One Score per (context ids, continuation ids); the continuation must be non-empty."""
        for _, cont in requests:
            if not cont:
                raise InputError("loglikelihood: an empty continuation has nothing to score")
            if len(cont) > self.max_length:
                raise InputError(f"loglikelihood: a continuation of {len(cont)} tokens exceeds the model's "
                                 f"context {self.max_length}")
        if self.family.next_token:
            return self._score_ar(requests)
        return [self._score_diffusion(list(ctx), list(cont)) for ctx, cont in requests]

    # ------------------------------------------------------------------ AR: exact

    @torch.no_grad()
    def _score_ar(self, requests) -> list[Score]:
        # as lm-eval's HF backend: the last max_length + 1 tokens, inputs all but the last one
        rows = [(list(ctx) + list(cont))[-(self.max_length + 1):] for ctx, cont in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out: list[Score | None] = [None] * len(rows)
        device = self.inference_model.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(rows[i]) - 1 for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
            logits = self.inference_model.model(input_ids=ids.to(device)).logits.double()
            logits[..., self.inference_model.mask_id] = float("-inf")
            logp = torch.log_softmax(logits, -1).cpu()
            for r, i in enumerate(batch):
                n_cont, n_in = len(requests[i][1]), len(rows[i]) - 1
                target = torch.tensor(rows[i][-n_cont:])
                lp = logp[r, n_in - n_cont:n_in]
                ll = lp.gather(1, target[:, None]).sum().item()
                out[i] = Score(ll, 0.0, bool((lp.argmax(-1) == target).all()), n_cont)
        return out

    # ------------------------------------------------------------------ diffusion: MC NELBO

    def noise_seed(self, context: Sequence[int]) -> int:
        """The seed of a request's draws: a function of --seed and the context tokens only."""
        return seed_for("lm-eval", self.seed, len(context), *context)

    @torch.no_grad()
    def draws(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """[N] float64 per-draw estimates of ll (conditional: -Σ continuation NELBO; joint: -mean
        per-token NELBO of context + continuation)."""
        tokens = (context + continuation)[-self.max_length:]
        n_ctx = len(tokens) - len(continuation)
        x = torch.tensor(tokens, dtype=torch.long)[None]
        prompt = (torch.arange(len(tokens)) < n_ctx)[None] if self.mode == "conditional" else None
        seed, n = self.noise_seed(context), self.num_mc_samples
        values = []
        for first in range(0, n, self.batch_size):
            ids = torch.arange(first, min(first + self.batch_size, n))
            rows = x.expand(len(ids), -1)
            inp = self.family.corrupt(rows, Noise(seed, ids, ids, n), None if prompt is None
                                      else prompt.expand(len(ids), -1)).to(self.inference_model.device)
            logits = self.inference_model.model(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma,
                                    attention_mask=inp.attend()).logits
            per_token = self.family.nelbo(logits.transpose(0, 1).contiguous(), inp).double().cpu()  # fp32 inside
            if self.mode == "conditional":
                # position_ids name each slot's sequence position (Eso-LM's are shuffled)
                positions = inp.position_ids.cpu()[:, :per_token.shape[1]]  # BD3-LM: the x_t copy's
                values.append(-(per_token * (positions >= n_ctx)).sum(1))
            else:
                values.append(-per_token.mean(1))
        return torch.cat(values)

    def _score_diffusion(self, context: list[int], continuation: list[int]) -> Score:
        values = self.draws(context, continuation)
        return Score(float(values.mean()), stratified_stderr(values), False, len(continuation))


def stratified_stderr(values: torch.Tensor) -> float:
    """Standard error of the mean of one draw per stratum, `values` in stratum order.

    Collapsed strata: adjacent strata are paired, Var(mean) ~ Σ_j (v_2j - v_2j+1)^2 / N^2.
    The iid formula std / sqrt(N) would count the spread *between* strata (the NELBO integrand
    varies strongly with t, by orders of magnitude for Duo near t = 1e-3), which stratification
    removes; the paired form is the standard, still conservative estimate. Odd N: the iid form."""
    n = values.numel()
    if n < 2:
        return float("nan")
    if n % 2:
        return float(values.std(unbiased=True) / math.sqrt(n))
    pairs = values.view(-1, 2)
    return float(((pairs[:, 0] - pairs[:, 1]) ** 2).sum().sqrt() / n)
