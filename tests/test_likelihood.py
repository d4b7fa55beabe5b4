"""The likelihood estimators behind the lm-eval model (megatron_dllm/evaluation/likelihood.py).

- The Monte-Carlo NELBO estimate is unbiased: on a tiny vocabulary and length its mean over many
  stratified draws matches the exact expectation, computed independently by enumerating every
  noised sequence (MDLM masks, Duo replacements, Eso-LM masks and orders) under Gauss-Legendre
  quadrature over t, to within 4 standard errors, and the reported standard error is right.
- Conditional mode never corrupts the prompt: the model never sees a noised prompt token.
- AR scores equal a dense log-softmax over the continuation ([MASK] excluded), with truncation
  from the left as lm-eval's Hugging Face backend.
"""
import itertools
import math

import numpy as np
import pytest
import torch

from megatron_dllm.evaluation.likelihood import LikelihoodEstimator
from megatron_dllm.families import get_family
from megatron_dllm.families.base import ModelInput
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.model.constants import T_EPS
from megatron_dllm.sampling import InferenceModel

V, MASK = 5, 4  # 4 real ids + [MASK]


def tiny(family, vocab=V, length=8, seed=0):
    model = random_dense_model(family, vocab, length, num_layers=1, scale=0.3, seed=seed)
    return InferenceModel(model.double(), family, vocab - 1, vocab, length, None, "hf")


pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest


def noised_sequences(family, x, free, t):
    """[(z, order, probability)]: every noised sequence of clean x at time t (positions not in
    `free` stay clean), with Eso-LM's clean-first random orders; written from the forward
    processes' definitions, not from families/."""
    a = 1 - (1 - T_EPS) * t
    out = []
    if family == "duo":
        choices = [range(V - 1) if i in free else [x[i]] for i in range(len(x))]
        for z in itertools.product(*choices):
            p = 1.0
            for i in free:
                p *= (1 - a) / (V - 1) + (a if z[i] == x[i] else 0.0)
            out.append((list(z), list(range(len(x))), p))
        return out
    for masked in itertools.product([False, True], repeat=len(free)):
        m = set(i for i, b in zip(free, masked) if b)
        p = (1 - a) ** len(m) * a ** (len(free) - len(m))
        z = [MASK if i in m else x[i] for i in range(len(x))]
        if family == "mdlm":
            out.append((z, list(range(len(x))), p))
            continue
        clean, noisy = [i for i in range(len(x)) if i not in m], sorted(m)
        orders = [list(c) + list(n) for c in itertools.permutations(clean) for n in itertools.permutations(noisy)]
        out += [(z, o, p / len(orders)) for o in orders]
    return out


def exact_ll(inf, context, continuation, mode, nodes=24):
    """E_t E_z[estimator's per-draw value], t uniform on [T_EPS, 1], by quadrature and enumeration."""
    family = get_family(inf.family, inf.mask_id, inf.vocab_size)
    x = context + continuation
    free = list(range(len(x))) if mode == "joint" else list(range(len(context), len(x)))
    u, w = np.polynomial.legendre.leggauss(nodes)
    total = 0.0
    for ui, wi in zip(u, w):
        t = T_EPS + (1 - T_EPS) * (ui + 1) / 2
        seqs = noised_sequences(inf.family, x, free, t)
        z = torch.tensor([s[0] for s in seqs])
        order = torch.tensor([s[1] for s in seqs])
        probs = torch.tensor([s[2] for s in seqs], dtype=torch.float64)
        tt = torch.full((len(seqs),), t)
        inp = ModelInput(input_ids=z.gather(1, order), position_ids=order,
                         sigma=family.schedule.sigma(tt).float() if inf.family == "duo" else torch.zeros(len(seqs)),
                         targets=torch.tensor([x] * len(seqs)).gather(1, order),
                         valid=torch.ones(z.shape), t=tt.float())
        with torch.no_grad():
            logits = inf.model(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma).logits
        per_token = family.nelbo(logits.float().transpose(0, 1).contiguous(), inp).double()
        if mode == "joint":
            value = -per_token.mean(1)
        else:
            value = -(per_token * (order >= len(context))).sum(1)
        total += wi / 2 * float((probs * value).sum())  # dt / (1 - eps) over [eps, 1] = du / 2
    return total


@pytest.mark.parametrize("family,mode", [("mdlm", "conditional"), ("mdlm", "joint"), ("duo", "conditional"),
                                         ("esolm", "conditional")])
def test_mc_nelbo_is_unbiased_against_exact_enumeration(family, mode):
    inf = tiny(family)
    context, continuation = [2], [1, 3]
    exact = exact_ll(inf, context, continuation, mode)
    est = LikelihoodEstimator(inf, num_mc_samples=2048, mode=mode, batch_size=512, seed=7)
    score, = est.score([(context, continuation)])
    # the quadrature has converged far below the estimate's standard error
    assert abs(exact - exact_ll(inf, context, continuation, mode, nodes=48)) < 0.02 * score.stderr
    assert abs(score.ll - exact) < 4 * score.stderr, (score.ll, exact, score.stderr)
    # the standard error is what it says: 16 independent estimates of 128 draws scatter by about it
    spread = []
    for seed in range(16):
        small = LikelihoodEstimator(inf, num_mc_samples=128, mode=mode, batch_size=128, seed=seed)
        spread.append(small.score([(context, continuation)])[0])
    lls = torch.tensor([s.ll for s in spread], dtype=torch.float64)
    mean_se = sum(s.stderr for s in spread) / len(spread)
    assert float(lls.std()) < 1.5 * mean_se  # the paired-strata standard error is conservative ...
    assert mean_se < 4 * float(lls.std())    # ... but not wildly so
    assert abs(float(lls.mean()) - exact) < 4 * mean_se / math.sqrt(len(spread))


@pytest.mark.parametrize("family", ["mdlm", "duo", "esolm"])
def test_conditional_mode_never_corrupts_the_prompt(family):
    inf = tiny(family)
    context, continuation = [0, 1, 2, 3, 0], [2, 1, 3]
    seen = []
    hook = inf.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (kwargs["input_ids"].clone(), kwargs["position_ids"].clone())), with_kwargs=True)
    try:
        est = LikelihoodEstimator(inf, num_mc_samples=64, batch_size=16, seed=3)
        est.score([(context, continuation)])
    finally:
        hook.remove()
    assert len(seen) == 4
    ids = torch.cat([i for i, _ in seen])
    pos = torch.cat([p for _, p in seen])
    in_order = torch.empty_like(ids).scatter_(1, pos, ids)  # Eso-LM feeds a shuffled order
    assert (in_order[:, :len(context)] == torch.tensor(context)).all()
    assert (in_order[:, len(context):] != torch.tensor(continuation)).any()  # the continuation is noised
    # joint mode noises the prompt too
    seen.clear()
    hook = inf.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        torch.empty_like(kwargs["input_ids"]).scatter_(1, kwargs["position_ids"], kwargs["input_ids"])),
        with_kwargs=True)
    try:
        joint = LikelihoodEstimator(inf, num_mc_samples=64, mode="joint", batch_size=64, seed=3)
        joint.score([(context, continuation)])
    finally:
        hook.remove()
    assert (torch.cat(seen)[:, :len(context)] != torch.tensor(context)).any()


def test_ar_scores_are_the_exact_log_probabilities():
    inf = tiny("ar", vocab=11, length=6)
    requests = [([1, 2, 3], [4, 5]), ([7], [8, 9, 0]), ([1, 2, 3, 4, 5, 6, 7], [8, 2])]  # the last is truncated
    scores = LikelihoodEstimator(inf, batch_size=2).score(requests)
    for (ctx, cont), score in zip(requests, scores):
        row = (ctx + cont)[-7:]
        with torch.no_grad():
            logits = inf.model(input_ids=torch.tensor([row[:-1]])).logits[0].double()
        logits[:, inf.mask_id] = float("-inf")
        logp = torch.log_softmax(logits, -1)[-len(cont):]
        expected = logp.gather(1, torch.tensor(cont)[:, None]).sum().item()
        assert score.ll == pytest.approx(expected, abs=1e-10) and score.stderr == 0.0
        assert score.greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())


def test_bad_requests_raise_clear_errors():
    inf = tiny("mdlm")
    with pytest.raises(ValueError, match="likelihood_mode 'full'"):
        LikelihoodEstimator(inf, mode="full")
    with pytest.raises(ValueError, match="empty continuation"):
        LikelihoodEstimator(inf).score([([1], [])])
    with pytest.raises(ValueError, match="exceeds the model's context 8"):
        LikelihoodEstimator(inf).score([([1], [1] * 9)])
