"""Samplers (megatron_dllm/sampling, tools/sample.py): valid ids and kept prompts for every family
and predictor; cached == uncached for AR (KV cache), MDLM (no-change cache) and Eso-LM (KV cache);
MDLM's samples against the exact distribution of the paper's chain, and its loop without host waits;
every sampler's output layer only where it draws (and the AR export's `logits_to_keep`);
float64 on the sampling path by default, and its draws are the paper code's in fewer buffers;
Duo's mixture against Bayes' rule and its samples against the paper's chain; Eso-LM plans; clear
errors; tools/sample.py end to end on a megatron checkpoint and on an HF directory.

Most tests use small randomly initialised HF models (weights ~ N(0, 0.2^2): the training init
zeroes adaLN and the output layer, which would make every distribution uniform)."""
import collections
import itertools
import json
import math
import os

import pytest
import torch
from conftest import REPO, launch_env, run_pretrain, run_python
from synchronisations import Synchronisations
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dllm.checkpoint.identity import ModelIdentity  # noqa: E402
from megatron_dllm.errors import InputError
from megatron_dllm.families.shift import shift_right
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.sampling import InferenceModel, SamplingConfig, categorical, decode, generate, get_sampler  # noqa: E402
from megatron_dllm.sampling.shifted_model import ShiftedModel

V, MASK, EOS, L = 33, 32, 0, 24
FAMILIES = ["ar", "mdlm", "duo", "esolm"]
PROMPT = [5, 6, 7, 8]


def random_model(family, vocab=V, length=L, hidden=32, seed=0):
    return random_dense_model(family, vocab, length, hidden_size=hidden, seed=seed)


@pytest.fixture(scope="module")
def models():
    return {f: InferenceModel(random_model(f), f, MASK, V, L, None, "hf") for f in FAMILIES}


def count_calls(inf):
    """Number of forward calls and of tokens run through the backbone."""
    stats = {"calls": 0, "tokens": 0}

    def hook(module, args, kwargs=None):
        stats["calls"] += 1
        stats["tokens"] += args[0].numel()

    return stats, inf.model.backbone.register_forward_pre_hook(hook)


def predictors(family):
    return ["ancestral", "left-to-right"] + (["block"] if family == "esolm" else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sampler_returns_valid_ids_and_keeps_prompt(models, family):
    inf = models[family]
    for predictor in predictors(family):
        for prompt in (None, PROMPT):
            cfg = SamplingConfig(steps=4, predictor=predictor, eos_id=EOS, stop_at_eos=False, top_p=0.9)
            x = generate(inf, cfg, num_samples=3, batch_size=2, seed=1, prompt_ids=prompt)
            assert x.shape == (3, L) and x.dtype == torch.long
            assert int(x.min()) >= 0 and int(x.max()) < V and not bool((x == MASK).any()), (predictor, x)
            if prompt:
                assert (x[:, :len(PROMPT)] == torch.tensor(PROMPT)).all()
            elif family == "ar":  # unconditional AR starts after an EOS (documents end with EOD)
                assert (x[:, 0] == EOS).all()
            assert len(set(x[:, 4:].flatten().tolist())) > 3, "outputs should not be trivial"


def test_ar_kv_cache_equals_uncached(models):
    inf = models["ar"]
    runs = {}
    for kv in (True, False):
        stats, handle = count_calls(inf)
        runs[kv] = generate(inf, SamplingConfig(kv_cache=kv, eos_id=EOS, stop_at_eos=False), num_samples=4,
                            batch_size=2, seed=3, prompt_ids=PROMPT)
        handle.remove()
        runs[kv, "tokens"] = stats["tokens"]
    assert torch.equal(runs[True], runs[False])
    assert runs[True, "tokens"] == 4 * (L - 1)  # every token runs through the model once
    assert runs[False, "tokens"] > 4 * L * (L - len(PROMPT)) // 2


def test_mdlm_no_change_cache_equals_uncached_and_saves_calls(models):
    inf = models["mdlm"]
    runs = {}
    for kv in (True, False):
        stats, handle = count_calls(inf)
        cfg = SamplingConfig(steps=64, kv_cache=kv, top_p=0.95)
        runs[kv] = generate(inf, cfg, num_samples=4, batch_size=2, seed=5, prompt_ids=PROMPT)
        handle.remove()
        runs[kv, "calls"] = stats["calls"]
    assert torch.equal(runs[True], runs[False])
    assert runs[False, "calls"] >= 2 * 64  # every step (and the greedy final step if masks remain)
    # a call only after a step that unmasked something: at most one per masked token, plus the first
    assert runs[True, "calls"] <= 2 * (2 * (L - len(PROMPT)) + 1) and runs[True, "calls"] < runs[False, "calls"]


def test_mdlm_samples_have_the_distribution_of_the_papers_step():
    """MDLM draws when each position unmasks, up front, then ids where positions unmask. Its samples
    must have the distribution of the paper's sampler: at each step one categorical per masked
    position over q = [p_x0 (a_s - a_t), [MASK]: 1 - a_s], the model called on the current canvas,
    then the greedy final step. That chain is enumerated exactly here (3 positions, 3 ids and
    [MASK]: 64 canvases) and 20,000 samples are held to it, outcome by outcome (5 sigma)."""
    ids, length, mask, steps, n = 3, 3, 3, 3, 20_000
    inf = InferenceModel(random_model("mdlm", vocab=ids + 1, length=length, seed=4), "mdlm", mask, ids + 1, length,
                         None, "hf")
    sampler = get_sampler(inf, SamplingConfig(steps=steps))

    @torch.no_grad()
    def p_x0(x):
        return sampler.probs(inf.model(input_ids=torch.tensor([x])).logits[0])

    chain = {(mask,) * length: 1.0}
    ts = sampler.timesteps()
    for t, s in zip(ts[:-1], ts[1:]):
        a_t, a_s = sampler.alpha(t), sampler.alpha(s)
        after = collections.defaultdict(float)
        for x, px in chain.items():
            p = p_x0(x) * (a_s - a_t) / (1 - a_t)
            moves = [[(token, 1.0)] if token != mask else
                     [(mask, (1 - a_s) / (1 - a_t)), *((v, float(p[i, v])) for v in range(ids))]
                     for i, token in enumerate(x)]
            for move in itertools.product(*moves):
                after[tuple(token for token, _ in move)] += px * math.prod(q for _, q in move)
        chain = after
    exact = collections.defaultdict(float)
    for x, px in chain.items():
        greedy = p_x0(x).argmax(-1).tolist()
        exact[tuple(greedy[i] if token == mask else token for i, token in enumerate(x))] += px
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)

    counts = collections.Counter(map(tuple, generate(inf, SamplingConfig(steps=steps), num_samples=n, batch_size=n,
                                                     seed=0).tolist()))
    for outcome in exact.keys() | counts.keys():
        p = exact.get(outcome, 0.0)
        assert abs(counts[outcome] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (outcome, counts[outcome] / n, p)


@pytest.mark.parametrize("noise_removal", ["greedy", "ancestral"])
def test_mdlm_final_step_takes_the_argmax_or_draws_from_p_x0(noise_removal, monkeypatch):
    """The positions still masked after the T steps (about 1e-5 of them: here all, by a plan that
    leaves every position to the final step) take the denoiser's argmax, or with
    `--noise-removal ancestral` (the step to alpha_s = 1) an id drawn from p_x0: 20,000 samples
    held to that product distribution, outcome by outcome (5 sigma)."""
    from megatron_dllm.sampling import mdlm

    class EverythingLeft(mdlm.UnmaskingPlan):
        def __init__(self, sampler, positions, generator):
            super().__init__(sampler, positions, generator)
            steps = sampler.cfg.steps
            self.slices = [(0, 0)] * steps + [(0, len(self.positions))]

    monkeypatch.setattr(mdlm, "UnmaskingPlan", EverythingLeft)
    ids, length, mask, n = 3, 3, 3, 20_000
    inf = InferenceModel(random_model("mdlm", vocab=ids + 1, length=length, seed=4), "mdlm", mask, ids + 1, length,
                         None, "hf")
    cfg = SamplingConfig(steps=2, noise_removal=noise_removal)
    with torch.no_grad():
        p_x0 = get_sampler(inf, cfg).probs(inf.model(input_ids=torch.full((1, length), mask)).logits[0])
    outcomes = itertools.product(range(ids), repeat=length)
    exact = ({tuple(p_x0.argmax(-1).tolist()): 1.0} if noise_removal == "greedy" else
             {x: math.prod(float(p_x0[i, v]) for i, v in enumerate(x)) for x in outcomes})
    counts = collections.Counter(map(tuple, generate(inf, cfg, num_samples=n, batch_size=n, seed=0).tolist()))
    for outcome in exact.keys() | counts.keys():
        p = exact.get(outcome, 0.0)
        assert abs(counts[outcome] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (outcome, counts[outcome] / n, p)


def test_noise_removal_is_refused_where_no_final_step_exists():
    for family, predictor in (("ar", "ancestral"), ("esolm", "ancestral"), ("mdlm", "left-to-right")):
        inf = InferenceModel(random_model(family, vocab=V, length=L), family, MASK, V, L, None, "hf")
        with pytest.raises(InputError, match=f"--noise-removal ancestral: the final step of the ancestral samplers "
                                             f"of mdlm, duo and bd3lm; --family {family} --predictor {predictor}"):
            get_sampler(inf, SamplingConfig(noise_removal="ancestral", predictor=predictor))


@pytest.mark.parametrize("backbone", ["dit", "gpt"])
def test_logits_at_runs_the_output_layer_at_those_positions_only(backbone):
    """`logits_at` (flat positions of [b, s], or a slice of every row's positions) gives the full
    forward's logits there (float64, a time input per row, with and without a padding mask), and
    the output layer receives only those rows; a shifted model's come from the position before
    (position 0 its own), as its full logits do."""
    gpt = GPTShape(ffn_hidden_size=64, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                   add_bias_linear=False, untie_embeddings_and_output_weights=True).as_dict()
    model = random_dense_model("mdlm", V, L, **({"gpt": gpt} if backbone == "gpt" else {})).double()
    head = model.get_output_embeddings()
    rows = []
    head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[:-1].numel()))
    x = torch.randint(0, MASK, (3, L))
    at = torch.tensor([0, 5, L - 1, L, 2 * L + 7])
    real = torch.ones(3, L, dtype=torch.bool)
    real[1, L - 4:] = False
    sigma = torch.tensor([0.1, 0.7, 2.0])  # a time input per row (Duo's; the DiT's adaLN reads it per row)
    with torch.no_grad():
        for mask in (None, real):
            full = model(input_ids=x, sigma=sigma, attention_mask=mask).logits.flatten(0, 1)
            part = model(input_ids=x, sigma=sigma, attention_mask=mask, logits_at=at).logits
            torch.testing.assert_close(part, full[at], rtol=1e-12, atol=1e-12)
        assert rows == [3 * L, len(at)] * 2
        cuts = (slice(3, 9), slice(0, 5), slice(L - 1, None), slice(0, 0), slice(4, 4))
        rows.clear()
        full = model(input_ids=x, sigma=sigma).logits
        for cut in cuts:
            torch.testing.assert_close(model(input_ids=x, sigma=sigma, logits_at=cut).logits, full[:, cut],
                                       rtol=1e-12, atol=1e-12)
        assert rows == [3 * L] + [3 * len(range(L)[cut]) for cut in cuts]
        shifted = ShiftedModel(model)
        full = shift_right(model(input_ids=x).logits, dim=1)
        torch.testing.assert_close(shifted(input_ids=x, logits_at=at).logits, full.flatten(0, 1)[at], rtol=1e-12,
                                   atol=1e-12)
        for cut in cuts:
            torch.testing.assert_close(shifted(input_ids=x, logits_at=cut).logits, full[:, cut], rtol=1e-12,
                                       atol=1e-12)
    with pytest.raises(ValueError, match="logits_at keeps only some"):
        model(input_ids=x, logits_at=at, labels=x)


def test_ar_logits_to_keep_runs_the_output_layer_at_the_last_positions_only():
    """transformers' `generate` asks an AR export for `logits_to_keep=1`: the last positions' logits
    (float64: equal to the full forward's), the output layer run only there, every position when
    `labels` need them; greedy `generate` then equals the argmax chain of full forwards."""
    model = random_model("ar").double()
    rows = []
    head = model.get_output_embeddings()
    head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[:-1].numel()))
    x = torch.randint(0, MASK, (3, L))
    with torch.no_grad():
        full = model(input_ids=x).logits
        torch.testing.assert_close(model(input_ids=x, logits_to_keep=2).logits, full[:, -2:], rtol=1e-12, atol=1e-12)
        out = model(input_ids=x, logits_to_keep=2, labels=x)
        torch.testing.assert_close(out.logits, full[:, -2:], rtol=1e-12, atol=1e-12)
        assert rows == [3 * L, 3 * 2, 3 * L]
        rows.clear()
        greedy = x[:1, :4]
        for _ in range(3):
            greedy = torch.cat([greedy, model(input_ids=greedy).logits[:, -1:].argmax(-1)], 1)
        rows.clear()
        assert torch.equal(model.generate(x[:1, :4], max_new_tokens=3, do_sample=False, eos_token_id=None), greedy)
    assert rows == [1, 1, 1]
    with pytest.raises(ValueError, match="logits_at keeps only some"):
        model(input_ids=x, logits_at=torch.tensor([0]), logits_to_keep=1)


DRAWING_CASES = [
    ("ar", {"kv_cache": True}), ("ar", {"kv_cache": False}),
    ("mdlm", {}), ("mdlm", {"kv_cache": False}), ("mdlm", {"predictor": "left-to-right"}),
    ("mdlm", {"predictor": "low-confidence"}), ("mdlm", {"block_length": 5, "approx_kv_cache": "prefix"}),
    ("duo", {}), ("duo", {"predictor": "left-to-right"}), ("duo", {"predictor": "threshold"}),
    ("duo", {"block_length": 5, "approx_kv_cache": "dual"}),
    ("esolm", {"kv_cache": True}), ("esolm", {"kv_cache": False}), ("esolm", {"predictor": "block", "steps": 2}),
    ("esolm", {"predictor": "left-to-right"}),
    ("bd3lm", {"kv_cache": True}), ("bd3lm", {"kv_cache": False}), ("bd3lm", {"predictor": "left-to-right"}),
    ("bd3lm-uniform", {}),
]


def count_rows_drawn(sampler, rows: list) -> None:
    """Append to `rows` the logit rows of every call of the sampler's `draw` and `greedy`."""
    def counted(method):
        def wrapped(logits, *args, **kwargs):
            rows.append(logits.numel() // logits.shape[-1])
            return method(logits, *args, **kwargs)
        return wrapped

    sampler.draw, sampler.greedy = counted(sampler.draw), counted(sampler.greedy)


@pytest.mark.parametrize("family,options", DRAWING_CASES, ids=lambda c: str(c))
def test_the_output_layer_runs_only_where_a_sampler_draws(models, family, options):
    """Every logit row the output layer computes goes into the sampler's draw or greedy choice, and
    nothing else does: the prompt, an Eso-LM slice's clean tokens, the positions a left-to-right step does
    not fill, the rest of an approximate cache's window and BD3-LM's commits get none. For `sample`
    and for a batch of prompts and canvases of different lengths (`sample_batch`)."""
    from megatron_dllm.sampling.prompt_batch import PromptBatch

    if family.startswith("bd3lm"):
        noise = "uniform" if family == "bd3lm-uniform" else "mask"
        extra = {"block_size": 4, "noise": noise}
        inf = InferenceModel(random_dense_model("bd3lm", V, L, family_options=extra), "bd3lm", MASK, V, L, None, "hf",
                             family_options=extra)
    else:
        inf = models[family]
    head_rows, drawn_rows = [], []
    handle = inf.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: head_rows.append(args[0].shape[:-1].numel()))
    sampler = get_sampler(inf, SamplingConfig(**{"steps": 4, "eos_id": EOS, **options}))
    count_rows_drawn(sampler, drawn_rows)
    try:
        with torch.no_grad():
            sampler.sample(torch.tensor([PROMPT, PROMPT]), torch.Generator().manual_seed(0))
            one = (sum(head_rows), sum(drawn_rows))
            prompts = [PROMPT, PROMPT[:2]]
            short = L - 4 if options.get("predictor") == "block" else L - 3  # Eso-LM's block plan: steps divide it
            sampler.sample_batch(PromptBatch(prompts, [L, short], [torch.Generator().manual_seed(s) for s in (1, 2)],
                                             torch.device("cpu")))
    finally:
        handle.remove()
    assert one[0] == one[1] > 0 and sum(head_rows) == sum(drawn_rows) > one[0], (one, head_rows, drawn_rows)


def test_the_mdlm_loop_makes_the_host_wait_nowhere(models):
    """The plan's counts are read once, before the loop: 8 steps and 64 dispatch the same
    synchronising operations (on a GPU every one of them would wait for the device)."""
    found = {}
    for steps in (8, 64):
        sampler = get_sampler(models["mdlm"], SamplingConfig(steps=steps, top_p=0.9))
        with torch.no_grad(), Synchronisations() as mode:
            sampler.sample(torch.tensor([PROMPT, PROMPT]), torch.Generator().manual_seed(0))
        found[steps] = mode.found
    assert found[8] == found[64] and len(found[64]) <= 2, found


@pytest.mark.parametrize("predictor,steps,prompt", [("ancestral", 7, None), ("ancestral", 12, PROMPT),
                                                   ("block", 4, PROMPT), ("left-to-right", 1, PROMPT)])
def test_esolm_kv_cache_equals_uncached(models, predictor, steps, prompt):
    inf = models["esolm"]
    runs = {}
    for kv in (True, False):
        stats, handle = count_calls(inf)
        cfg = SamplingConfig(steps=steps, predictor=predictor, kv_cache=kv, eos_id=EOS, stop_at_eos=False)
        runs[kv] = generate(inf, cfg, num_samples=4, batch_size=2, seed=7, prompt_ids=prompt)
        handle.remove()
        runs[kv] = (runs[kv], stats)
    assert torch.equal(runs[True][0], runs[False][0])
    cached, full = runs[True][1], runs[False][1]
    assert cached["calls"] == full["calls"]
    # cached: each token once as a mask and once as a clean token (at most), never more
    assert cached["tokens"] <= 4 * 2 * L < full["tokens"]


class NewBuffers(TorchDispatchMode):
    """The tensors of at least `numel` elements that operations return in new storage (views and
    results written into an argument left out)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        self.count += sum(1 for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and not func.is_view
                          and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in given)
        return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_categorical_draws_in_fewer_buffers(dtype):
    """`sample` in float32 draws exactly argmax(p / (1e-10 - log(U + 1e-10))) (the paper code's
    race) from the same generator, with one buffer of p's size where the formula written out takes
    five; in float64 it inverts p's cumulative sum at one uniform per row from the generator
    (`sample_by_cdf`), with no buffer of p's size. `probabilities` is softmax(logits / T) with
    [MASK] at -inf, bit for bit, in one copy of the logits (softmax written over it), and leaves
    them as they were (float64 logits included)."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 500, generator=gen, dtype=dtype)
    probs[:, ::7] = 0.0
    kept = probs.clone()
    mine, plain = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    with NewBuffers(probs.numel()) as buffers:
        ids = categorical.sample(probs, mine)
    if dtype == torch.float64:
        u = torch.rand(64, generator=plain, dtype=dtype)
        assert torch.equal(ids, categorical.sample_by_cdf(kept, u)) and buffers.count == 0
    else:
        u = torch.rand(probs.shape, generator=plain, dtype=dtype)
        assert torch.equal(ids, (probs / (1e-10 - torch.log(u + 1e-10))).argmax(-1)) and buffers.count == 1
    for source in (torch.float32, torch.float64):
        logits = (4 * torch.randn(64, 500, generator=gen)).to(source)
        kept = logits.clone()
        with NewBuffers(logits.numel()) as buffers:
            p = categorical.probabilities(logits, dtype, temperature=0.7, suppress=3)
        written = (logits.to(dtype) / 0.7).clone()
        written[:, 3] = float("-inf")
        assert torch.equal(p, written.softmax(-1)) and torch.equal(logits, kept) and buffers.count == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_draws_by_cdf_invert_the_cumulative_sum_in_place(dtype):
    """`sample_by_cdf` takes the first id whose cumulative probability reaches (1 - u) x the row's
    total (u = 0: the last id of nonzero probability), never an id of probability 0, and makes no
    buffer of the distribution's size (its cumulative sum is written over it)."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 500, generator=gen, dtype=dtype)
    probs[:, ::7] = 0.0
    probs[:, -3:] = 0.0
    u = torch.rand(64, generator=gen, dtype=dtype)
    u[0] = 0.0
    cdf = probs.cumsum(-1)
    expected = [int((c >= (1 - x) * c[-1]).nonzero()[0]) for c, x in zip(cdf, u)]
    with NewBuffers(probs.numel()) as buffers:
        ids = categorical.sample_by_cdf(probs, u)
    assert ids.tolist() == expected and buffers.count == 0 and torch.equal(probs, cdf)
    assert ids[0] == 496 and (ids % 7 != 0).all()  # the last nonzero id; zeros never drawn


def test_float64_is_default_and_reaches_categorical(models, monkeypatch):
    assert SamplingConfig().float64 is True
    seen = []
    real = categorical.probabilities

    def spy(logits, dtype, *args, **kwargs):
        seen.append(dtype)
        return real(logits, dtype, *args, **kwargs)

    monkeypatch.setattr(categorical, "probabilities", spy)
    for family in FAMILIES:
        for float64, dtype in ((True, torch.float64), (False, torch.float32)):
            seen.clear()
            # the default config must sample in float64
            cfg = SamplingConfig(steps=4, eos_id=EOS) if float64 else SamplingConfig(steps=4, eos_id=EOS,
                                                                                       float64=False)
            generate(models[family], cfg, num_samples=2, seed=0)
            assert seen and set(seen) == {dtype}, (family, float64, set(seen))


def test_duo_mixture_is_bayes_rule():
    """Duo's step draws from q(z_s | z_t = z, x ~ x_theta) as a mixture (stay at z, draw from
    x_theta, uniform id) whose weights depend on x_theta[z] alone: the mixture written out equals
    Bayes' rule over the chain's marginals, for every z."""
    from megatron_dllm.sampling.duo import mixture

    torch.manual_seed(0)
    vocab, mask, n_real = 6, 5, 5
    x_theta = torch.rand(n_real, dtype=torch.float64).softmax(0)
    x_theta = torch.cat([x_theta, torch.zeros(1, dtype=torch.float64)])
    a_t, a_s = 0.3, 0.7
    real = torch.arange(vocab) != mask

    def q_marginal(a):  # q(z | x) = a 1[z = x] + (1 - a)/V over the real ids, as a [x, z] matrix
        return (a * torch.eye(vocab, dtype=torch.float64) + (1 - a) / n_real) * real * real[:, None]

    step = (a_t / a_s) * torch.eye(vocab, dtype=torch.float64) + (1 - a_t / a_s) / n_real  # q(z_t | z_s)
    step = step * real * real[:, None]
    for z in range(n_real):
        joint = (x_theta[:, None] * q_marginal(a_s) * step[:, z][None, :]).sum(0)  # sum over x
        stay, model, noise = mixture(x_theta[z], a_t, a_s, n_real)
        q = stay * torch.eye(vocab, dtype=torch.float64)[z] + model * x_theta + noise * real.double() / n_real
        torch.testing.assert_close(q / (stay + model + noise), joint / joint.sum(), rtol=1e-14, atol=1e-15)
        assert float(stay + model + noise) == pytest.approx(a_t * n_real * float(x_theta[z]) + 1 - a_t, rel=1e-14)


def test_duo_draw_makes_no_buffer_of_the_distributions_size(models, monkeypatch):
    """A Duo step's draw forms x_theta in float64 a chunk of positions at a time (here 3) and works
    it into its cumulative sum in place: no tensor of the whole distribution's size is made (the
    posterior and the race made two per step, beside x_theta)."""
    from megatron_dllm.sampling.duo import draw

    monkeypatch.setitem(categorical.CHUNK_BYTES, "cpu", 3 * V * 8)
    sampler = get_sampler(models["duo"], SamplingConfig())
    logits = 4 * torch.randn(2, L, V, generator=torch.Generator().manual_seed(1))
    z = torch.randint(0, MASK, (2, L))
    with NewBuffers(logits.numel()) as buffers:
        ids = draw(sampler, logits, z, 0.3, 0.5, torch.Generator().manual_seed(0))
    assert buffers.count == 0 and ids.shape == z.shape and (ids != MASK).all()


@pytest.mark.parametrize("suppress", [0, 3, 499, None])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_greedy_is_the_argmax_of_the_distribution_without_forming_it(suppress, source):
    """`categorical.greedy` (the greedy tails of MDLM and Duo) gives the argmax of `probabilities`
    in float64 at temperature 0.7 and top-p 1 or 0.9, with [MASK] first, inside, last or absent
    and its own logit the largest, ties to the lower id, and makes no buffer of the logits' size."""
    gen = torch.Generator().manual_seed(6)
    logits = (4 * torch.randn(64, 500, generator=gen)).to(source)
    logits[:8, 1] = logits[:8, 10] = logits[:8].max() + 1  # a tie (across [MASK] at 3): the lower id
    logits[8:16, suppress or 0] = 100
    with NewBuffers(logits.numel()) as buffers:
        got = categorical.greedy(logits, suppress)
    assert buffers.count == 0 and (got[:8] == 1).all()
    for top_p in (1.0, 0.9):
        assert torch.equal(got, categorical.probabilities(logits, torch.float64, 0.7, top_p, suppress).argmax(-1))


def test_temperatures_that_would_overflow_the_logits_are_refused():
    """logits / 1e-308 overflow to inf, NaN probabilities, an id past the vocabulary (a traceback
    or, in float32, every id 0): refused, with NaN and inf, as the flag's own error."""
    for temperature in (float("nan"), float("inf"), 0.0, 1e-308, 1e-40):
        with pytest.raises(InputError, match="--temperature .*: must be a finite number >= 1e-30"):
            SamplingConfig(temperature=temperature).check()
    SamplingConfig(temperature=1e-30).check()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_draws_a_chunk_of_rows_at_a_time_with_the_ids_of_one_draw(dtype, monkeypatch):
    """`categorical.draw` forms the distribution a chunk of rows at a time (here 3 rows in float64)
    and draws the ids that `sample` draws from `probabilities` over every row with the same
    generator, bit for bit, top-p included; with `at` also each row's probability of that id. In
    float64 no buffer of the whole distribution's size is made. Chunks: 8 MiB on a CPU, 1 GiB on a GPU."""
    monkeypatch.setitem(categorical.CHUNK_BYTES, "cpu", 3 * 500 * 8)
    gen = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(4, 5, 500, generator=gen)
    at = torch.randint(0, 500, (4, 5), generator=gen)
    probs = categorical.probabilities(logits, dtype, temperature=0.7, top_p=0.9, suppress=3)
    want = categorical.sample(probs.clone(), torch.Generator().manual_seed(9))
    with NewBuffers(probs.numel()) as buffers:
        ids, p_at = categorical.draw(logits, dtype, torch.Generator().manual_seed(9), temperature=0.7, top_p=0.9,
                                     suppress=3, at=at)
    assert torch.equal(ids, want) and torch.equal(p_at, probs.gather(-1, at[..., None])[..., 0])
    if dtype == torch.float64:  # float32 keeps the race, a uniform per id of every row at once
        assert buffers.count == 0
    assert categorical.draw(logits[:0], dtype, torch.Generator()).shape == (0, 5)  # a step with no rows
    monkeypatch.undo()
    assert [len(categorical.row_chunks(100, 32001, torch.float64, torch.device(d))) for d in ("cpu", "cuda")] == [4, 1]


def test_a_greedy_draw_is_the_argmax_with_the_draws_uniforms_consumed():
    """Greedy decoding's vanishing top-p leaves a nucleus of one id: `draw` takes the argmax, with
    no distribution formed and no sort of the vocabulary, and still draws its uniforms, so the ids
    and the generator's state after are those of the full draw."""
    gen = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(4, 5, 500, generator=gen)
    at = torch.randint(0, 500, (4, 5), generator=gen)
    at[0, 0] = categorical.greedy(logits[0, 0], 3)  # a row asking for its argmax's probability
    for top_p in (1e-12, 0.5 / 500):
        full, fast = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        probs = categorical.probabilities(logits, torch.float64, 0.7, top_p, suppress=3)
        want = categorical.sample(probs.clone(), full)
        with NewBuffers(probs.numel()) as buffers:
            ids, p_at = categorical.draw(logits, torch.float64, fast, temperature=0.7, top_p=top_p, suppress=3, at=at)
        assert torch.equal(ids, want) and torch.equal(p_at, probs.gather(-1, at[..., None])[..., 0])
        assert torch.equal(full.get_state(), fast.get_state()) and buffers.count == 0 and p_at[0, 0] == 1
    assert categorical.one_id(1e-12, 32001) and not categorical.one_id(1e-2, 500)


@pytest.mark.parametrize("noise_removal", ["greedy", "ancestral"])
def test_duo_samples_have_the_distribution_of_the_papers_step(noise_removal):
    """Duo draws each position from a mixture (`duo.draw`), not from the posterior formed over the
    vocabulary as the paper's sampler does. Its samples must have the distribution of that chain:
    uniform ids to start, at each step one categorical per position over the posterior q (Bayes'
    rule over the chain's marginals, with the model called on the current canvas at sigma =
    -log alpha_t), then the greedy tail (or, `--noise-removal ancestral`, one more posterior step
    to alpha_s = 1). Enumerated exactly here (3 positions, 3 ids: 27 canvases) and 20,000 samples
    are held to it, outcome by outcome (5 sigma)."""
    ids, length, mask, steps, n = 3, 3, 3, 3, 20_000
    inf = InferenceModel(random_model("duo", vocab=ids + 1, length=length, seed=4), "duo", mask, ids + 1, length,
                         None, "hf")
    cfg = SamplingConfig(steps=steps, noise_removal=noise_removal)
    sampler = get_sampler(inf, cfg)

    @torch.no_grad()
    def x_theta(x, a):
        return sampler.probs(inf.model(input_ids=torch.tensor([x]), sigma=torch.tensor([-math.log(a)])).logits[0])

    def posterior(x, z, a_t, a_s):  # Bayes' rule: sum over x0 of x(x0) q(z_s | x0) q(z_t = z | z_s), over z_s
        marginal = a_s * torch.eye(ids, dtype=torch.float64) + (1 - a_s) / ids  # [x0, z_s]
        step = (a_t / a_s) * torch.eye(ids, dtype=torch.float64)[:, z] + (1 - a_t / a_s) / ids  # [z_s]
        joint = (x[:ids, None] * marginal).sum(0) * step
        return joint / joint.sum()

    chain = {x: ids ** -length for x in itertools.product(range(ids), repeat=length)}
    ts = sampler.timesteps()
    alphas = [sampler.alpha(t) for t in ts] + ([1.0] if noise_removal == "ancestral" else [])
    for a_t, a_s in zip(alphas[:-1], alphas[1:]):
        after = collections.defaultdict(float)
        for x, px in chain.items():
            probs = x_theta(x, a_t)
            moves = [posterior(probs[i], z, a_t, a_s).tolist() for i, z in enumerate(x)]
            for move in itertools.product(range(ids), repeat=length):
                after[move] += px * math.prod(moves[i][v] for i, v in enumerate(move))
        chain = after
    exact = collections.defaultdict(float)
    for x, px in chain.items():
        final = x_theta(x, sampler.alpha(ts[-1])).argmax(-1).tolist() if noise_removal == "greedy" else x
        exact[tuple(final)] += px
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)

    counts = collections.Counter(map(tuple, generate(inf, cfg, num_samples=n, batch_size=n, seed=0).tolist()))
    assert len(counts) > 3  # the greedy tail leaves more than a few outcomes to check
    for outcome in exact.keys() | counts.keys():
        p = exact.get(outcome, 0.0)
        assert abs(counts[outcome] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (outcome, counts[outcome] / n, p)


def test_esolm_plans():
    inf = InferenceModel(random_model("esolm", length=32), "esolm", MASK, V, 32, None, "hf")
    g = torch.Generator().manual_seed(0)
    order, counts = get_sampler(inf, SamplingConfig(steps=50)).plan(3, 4, g, "cpu")
    assert len(counts) == 50 and sum(counts) == 28 and all(c >= 0 for c in counts)
    assert (order[:, :4].sort(-1).values == torch.arange(4)).all()  # the prompt first
    assert (order.sort(-1).values == torch.arange(32)).all()  # a permutation per row
    order, counts = get_sampler(inf, SamplingConfig(steps=4, predictor="block")).plan(3, 8, g, "cpu")
    assert counts == [6] * 4
    for row in order:
        for step in range(4):
            chunk = row[8 + 6 * step: 8 + 6 * (step + 1)]
            assert len(set((chunk % 4).tolist())) == 1 and (chunk.diff() == 4).all()  # {s, s + L', ...}
        assert sorted(row.tolist()) == list(range(32))


def test_nucleus_keeps_the_smallest_top_set():
    p = torch.tensor([[0.5, 0.1, 0.3, 0.1]], dtype=torch.float64)
    torch.testing.assert_close(categorical.nucleus(p.clone(), 0.7), torch.tensor([[0.625, 0.0, 0.375, 0.0]],
                                                                                 dtype=torch.float64))
    torch.testing.assert_close(categorical.nucleus(p.clone(), 0.2), torch.tensor([[1.0, 0, 0, 0]],
                                                                                 dtype=torch.float64))


def test_nucleus_is_the_formula_written_out_over_its_input():
    """The kept mass renormalised, bit for bit as the formula written out (sort, mass above each id,
    zero beyond top_p, scatter back, divide), in the input's own buffer plus the sort's values and
    int64 order, the running mass and a bool mask (the formula written out makes eight)."""
    gen = torch.Generator().manual_seed(4)
    probs = torch.rand(64, 500, generator=gen, dtype=torch.float64).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    plain = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= 0.9, 0.0)
    plain = torch.zeros_like(probs).scatter_(-1, order, plain)
    plain = plain / plain.sum(-1, keepdim=True)
    given = probs.clone()
    with NewBuffers(probs.numel()) as buffers:
        kept = categorical.nucleus(given, 0.9)
    assert torch.equal(kept, plain) and kept.data_ptr() == given.data_ptr() and buffers.count == 4


class _Tok:
    eod = EOS

    def detokenize(self, ids):
        return " ".join(map(str, ids))


def test_stop_at_eos_and_decode(models):
    inf = models["ar"]
    model = random_model("ar")
    with torch.no_grad():
        model.backbone.output_layer.linear.bias[EOS] += 100.0  # EOS always next
    eager = InferenceModel(model, "ar", MASK, V, L, _Tok(), "hf")
    x = generate(eager, SamplingConfig(stop_at_eos=True), num_samples=2, prompt_ids=PROMPT)
    assert (x[:, len(PROMPT):] == EOS).all()
    assert decode(eager, x) == ["5 6 7 8"] * 2
    row = torch.tensor([[EOS, EOS, 3, 4, EOS, 9]])
    assert decode(eager, row) == ["3 4 9"]  # the whole sample, EOD dropped (the paper's decoding)
    assert decode(eager, row, cut_at_eod=True) == ["3 4"]  # start token dropped, first document only
    with pytest.raises(ValueError, match="decode needs a tokenizer"):
        decode(inf, x)


def test_wrong_requests_raise_clear_errors(models):
    cases = [
        ("mdlm", dict(predictor="block"), "--predictor block is not available for --family mdlm; valid: "
                                          "ancestral, left-to-right, low-confidence, threshold, entropy-bound"),
        ("ar", dict(predictor="block"), "--predictor block is not available for --family ar; valid: ancestral, "
                                        "left-to-right"),
        ("duo", dict(predictor="block"), "--predictor block is not available for --family duo"),
        ("esolm", dict(predictor="block", steps=L + 1), "--predictor block needs --steps to divide"),
        ("esolm", dict(predictor="block", steps=5), "--predictor block needs --steps to divide"),
        ("esolm", dict(predictor="gibbs"), "--predictor 'gibbs' is unknown; valid: ancestral, block"),
        ("mdlm", dict(seq_length=L + 1), "--seq-length 25 exceeds the model's context 24"),
        ("mdlm", dict(top_p=0.0), "--top-p 0.0"),
        ("mdlm", dict(steps=0), "--steps 0"),
        ("ar", dict(max_new_tokens=4), "--max-new-tokens applies to --family bd3lm only; --family ar fills "
                                       "--seq-length"),
    ]
    for family, kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            generate(models[family], SamplingConfig(**kwargs), num_samples=1)
        assert message in str(err.value), (family, kwargs, str(err.value))
    with pytest.raises(ValueError, match="prompt length"):
        generate(models["esolm"], SamplingConfig(steps=4, predictor="block"), prompt_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="must be shorter than the sequence length"):
        generate(models["mdlm"], SamplingConfig(), prompt_ids=list(range(L)))
    with pytest.raises(ValueError, match="no tokenizer to name it"):
        generate(models["ar"], SamplingConfig())


# --------------------------------------------------------------------------- tools/sample.py

RUN = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
       "--train-iters", "2", "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-interval", "100"]


@pytest.fixture(scope="module")
def esolm_checkpoint(demo_cache, tmp_path_factory):
    work = tmp_path_factory.mktemp("sample_ckpt")
    run_pretrain(1, ["--demo-cache-dir", demo_cache, "--family", "esolm", *RUN, "--save", str(work / "ckpt"),
                     "--tensorboard-dir", str(work / "tb")], work)
    return str(work / "ckpt")


@pytest.mark.slow
def test_sample_tool_on_megatron_checkpoint(esolm_checkpoint, tmp_path):
    out = tmp_path / "out.json"
    proc = run_python([os.path.join(REPO, "tools", "sample.py"), "--load", esolm_checkpoint, "--num-samples", "3",
                       "--steps", "8", "--batch-size", "2", "--prompt", "To be", "--top-p", "0.9", "--device", "cpu",
                       "--output", "out.json"], tmp_path, launch_env(1), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    settings = record["settings"]
    assert settings["output"] == str(out)  # absolute: the record names its files wherever it is read
    assert settings["family"] == "esolm" and settings["source"] == "megatron" and settings["steps"] == 8
    assert settings["top_p"] == 0.9 and settings["seq_length"] == 32 and record["wall_time_s"] > 0
    tokens = torch.tensor(record["tokens"])
    assert tokens.shape == (3, 32) and int(tokens.max()) < 4096  # [MASK] = 4096 never in the output
    prompt = settings["prompt_ids"]
    assert (tokens[:, :len(prompt)] == torch.tensor(prompt)).all()
    assert len(record["texts"]) == 3 and all(t.startswith("To be") for t in record["texts"])


@pytest.fixture(scope="module")
def hf_dir(demo_cache, tmp_path_factory):
    from megatron_dllm.data.prep.demo import prepare_demo_corpus
    from megatron_dllm.hf import export

    tok = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    out = str(tmp_path_factory.mktemp("hf") / "mdlm")
    model = random_model("mdlm", vocab=4097, length=32)
    identity = ModelIdentity("mdlm", hidden_size=32, num_layers=2, num_attention_heads=2, vocab_size=4097,
                             mask_id=4096)
    config = export.hf_config_dict(identity, "bidirectional", 32)
    config["cond_dim"] = 16
    export.write_hf_dir(out, model.state_dict(), config)
    export.export_tokenizer(out, "SentencePieceTokenizer", tok, 4097, 4096)
    return out


@pytest.mark.slow
def test_sample_tool_on_hf_dir(hf_dir, tmp_path, capsys):
    from megatron_dllm.cli import sample

    out = tmp_path / "out.json"
    assert sample.main(["--load", hf_dir, "--num-samples", "2", "--steps", "16", "--no-kv-cache",
                        "--no-float64", "--seed", "3", "--output", str(out), "--device", "cpu",
                        "--dtype", "bfloat16"]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["source"] == "hf" and record["settings"]["float64"] is False
    assert record["settings"]["dtype"] == "bfloat16"
    tokens = torch.tensor(record["tokens"])
    assert tokens.shape == (2, 32) and int(tokens.max()) < 4096
    assert all(isinstance(t, str) for t in record["texts"])


@pytest.mark.slow
def test_sample_tool_without_a_tokenizer_says_so(hf_dir, tmp_path, capsys):
    """A model without a tokenizer (a convert_from_hf checkpoint) samples ids, with a note that the
    texts are null; what needs text (--prompt, --cut-at-eod) is refused."""
    import shutil

    from megatron_dllm.cli import sample

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(hf_dir):
        if not name.startswith("tokenizer") and name != "special_tokens_map.json":
            shutil.copy(os.path.join(hf_dir, name), bare / name)
    argv = ["--load", str(bare), "--num-samples", "2", "--steps", "4", "--device", "cpu"]
    assert sample.main([*argv, "--output", str(tmp_path / "ids.json")]) == 0
    assert json.loads((tmp_path / "ids.json").read_text())["texts"] is None
    assert capsys.readouterr().err.startswith(f"note: --load {bare} records no tokenizer")
    for flag in ("--cut-at-eod", "--stop-at-eos"):  # both need the EOD id
        assert sample.main([*argv, flag, "--output", str(tmp_path / "cut.json")]) == 2
        assert capsys.readouterr().err.strip() == (f"error: {flag} needs a tokenizer: give "
                                                   f"--tokenizer-type/--tokenizer-model")


@pytest.mark.slow
def test_sample_tool_compile_gives_the_eager_samples(hf_dir, tmp_path, monkeypatch):
    """--compile samples through `InferenceModel.compile()` (here with AOTAutograd's graphs and no
    code generation, which costs a minute a graph on CPU: tests/test_cuda_graphs.py says more)."""
    from megatron_dllm.cli import sample

    compiled = []
    real = InferenceModel.compile
    monkeypatch.setattr(InferenceModel, "compile", lambda self: compiled.append(1) or real(self, backend="aot_eager"))
    records = []
    for flags in ([], ["--compile"]):
        out = tmp_path / f"out{len(flags)}.json"
        assert sample.main(["--load", hf_dir, "--num-samples", "2", "--steps", "4", "--seed", "3", "--device", "cpu",
                            "--output", str(out), *flags]) == 0
        records.append(json.loads(out.read_text()))
    assert compiled == [1] and records[1]["settings"]["compile"] is True
    assert records[1]["tokens"] == records[0]["tokens"]


@pytest.mark.parametrize("argv,message", [
    (["--load", "/nonexistent/ckpt"], "error: --load /nonexistent/ckpt: no such file or directory"),
    (["--predictor", "block", "--steps", "4"], "error: --predictor block is not available for --family mdlm"),
    (["--steps", "0"], "error: --steps 0: must be >= 1"),
    (["--num-samples", "x"], "error: argument --num-samples: invalid int value"),
    (["--cuda-graphs", "--device", "cpu"],
     "error: --cuda-graphs: CUDA graphs need the model on a CUDA device; it is on cpu"),
])
@pytest.mark.slow
def test_sample_tool_bad_input(hf_dir, tmp_path, capsys, argv, message):
    from megatron_dllm.cli import sample

    argv = argv if "--load" in argv else ["--load", hf_dir, *argv]
    try:
        code = sample.main([*argv, "--output", str(tmp_path / "o.json")])
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "o.json").exists()


def test_ar_samples_run_the_full_length_past_eos():
    """The paper's AR samples never stop: after an EOS the row goes on with real tokens; with
    stop_at_eos (the earlier default) everything after the first generated EOS is EOS."""
    model = random_model("ar")
    with torch.no_grad():
        model.backbone.output_layer.linear.bias[EOS] += 2.5  # EOS frequent, not certain
    inf = InferenceModel(model, "ar", MASK, V, L, _Tok(), "hf")
    full = generate(inf, SamplingConfig(), num_samples=8, prompt_ids=PROMPT)[:, len(PROMPT):]
    stopped = generate(inf, SamplingConfig(stop_at_eos=True), num_samples=8, prompt_ids=PROMPT)[:, len(PROMPT):]
    first = (full == EOS).long().argmax(1)
    has_eos = (full == EOS).any(1)
    after = torch.arange(full.shape[1])[None] > first[:, None]
    assert has_eos.any() and ((full != EOS) & after & has_eos[:, None]).any()  # real tokens after an EOS
    s_first = (stopped == EOS).long().argmax(1)
    s_after = (torch.arange(stopped.shape[1])[None] >= s_first[:, None]) & (stopped == EOS).any(1)[:, None]
    assert s_after.any() and (stopped[s_after] == EOS).all()
