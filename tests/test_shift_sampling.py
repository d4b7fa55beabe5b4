"""MDLM's `--shift` (an MDLM adapted from an AR model: the logits at i - 1 predict token i) at
sampling and evaluation time: recorded with the model (checkpoint identity, HF config.json; a
checkpoint without it is unshifted), and every sampler of a shifted model reads token i from the
model's logits at i - 1, as training scores it. The references are built here: the shift written
out on the raw logits, and greedy decoding by hand. Random float64 models on CPU, in-process."""
import pytest
import torch
from test_batched_generation import EOS, PROMPTS, SEEDS, L
from test_sampling import MASK, V, random_model

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.meta import CheckpointMeta
from megatron_dllm.errors import InputError
from megatron_dllm.families import get_family
from megatron_dllm.model.builder import Architecture
from megatron_dllm.model.presets import Preset
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate, get_sampler
from megatron_dllm.sampling.conditional import generate_left_to_right_batch, generate_native_batch

SHIFT = {"shift": True}


class ShiftedByHand(torch.nn.Module):
    """The dense reference: the raw model, its logits moved one position right (token i read from
    the logits at i - 1, token 0 from its own), written out here rather than taken from the package;
    `logits_at` (flat positions or a slice of every row's) picks from the shifted logits of every
    position."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, logits_at=None, **inputs):
        out = self.inner(input_ids=input_ids, **inputs)
        out.logits = torch.cat([out.logits[:, :1], out.logits[:, :-1]], dim=1)
        if isinstance(logits_at, slice):
            out.logits = out.logits[:, logits_at]
        elif logits_at is not None:
            out.logits = out.logits.flatten(0, 1)[logits_at]
        return out


@pytest.fixture(scope="module")
def raw():
    return random_model("mdlm", length=L).to(torch.float64)


def shifted(raw):
    return InferenceModel(raw, "mdlm", MASK, V, L, None, "hf", family_options=dict(SHIFT))


def by_hand(raw):
    return InferenceModel(ShiftedByHand(raw), "mdlm", MASK, V, L, None, "hf")


def test_greedy_left_to_right_reads_token_i_from_the_logits_at_i_minus_1(raw):
    prompt = PROMPTS[1]
    cfg = SamplingConfig(steps=4, predictor="left-to-right", top_p=1e-9, stop_at_eos=False)
    got = generate(shifted(raw), cfg, num_samples=1, seed=0, prompt_ids=[prompt])[0]
    x = torch.full((1, L), MASK)
    x[0, :len(prompt)] = torch.tensor(prompt)
    for i in range(len(prompt), L):  # the definition: token i is the argmax of logits[i - 1], [MASK] excluded
        logits = raw(input_ids=x).logits[0, i - 1]
        logits[MASK] = -torch.inf
        x[0, i] = logits.argmax()
    assert torch.equal(got, x[0])
    unshifted = generate(InferenceModel(raw, "mdlm", MASK, V, L, None, "hf"), cfg, num_samples=1, seed=0,
                         prompt_ids=[prompt])[0]
    assert not torch.equal(unshifted, got)  # the shift changes the samples: the test can fail


@pytest.mark.parametrize("predictor,knobs", [("ancestral", {}), ("ancestral", {"block_length": 4}),
                                             ("left-to-right", {}), ("low-confidence", {"block_length": 4}),
                                             ("threshold", {"confidence_threshold": 0.2}),
                                             ("entropy-bound", {"entropy_bound": 0.5})])
def test_every_mdlm_sampler_equals_sampling_the_shifted_logits(raw, predictor, knobs):
    cfg = SamplingConfig(steps=6, predictor=predictor, **knobs)
    for prompt in (None, PROMPTS[0]):
        got = generate(shifted(raw), cfg, num_samples=2, seed=3, prompt_ids=prompt)
        assert torch.equal(got, generate(by_hand(raw), cfg, num_samples=2, seed=3, prompt_ids=prompt))
        unshifted = InferenceModel(raw, "mdlm", MASK, V, L, None, "hf")
        assert not torch.equal(got, generate(unshifted, cfg, num_samples=2, seed=3, prompt_ids=prompt))
    # prompts of different lengths in one padded batch (conditional generation)
    native = dict(steps=5, seeds=SEEDS, predictor=predictor, **knobs)
    if predictor == "left-to-right":
        assert (generate_left_to_right_batch(shifted(raw), PROMPTS, 10, EOS, seeds=SEEDS)
                == generate_left_to_right_batch(by_hand(raw), PROMPTS, 10, EOS, seeds=SEEDS))
    else:
        assert (generate_native_batch(shifted(raw), PROMPTS, 10, EOS, **native)
                == generate_native_batch(by_hand(raw), PROMPTS, 10, EOS, **native))


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_approximate_kv_caches_are_refused_for_a_shifted_model(raw, mode):
    cfg = SamplingConfig(steps=4, block_length=4, approx_kv_cache=mode)
    with pytest.raises(InputError, match=f"--approx-kv-cache {mode}: this model was trained with --shift"):
        get_sampler(shifted(raw), cfg)
    get_sampler(InferenceModel(raw, "mdlm", MASK, V, L, None, "hf"), cfg)  # unshifted: as before


def test_the_shift_is_part_of_the_model_identity():
    arch = Architecture(Preset(32, 2, 2), V, L, "bidirectional")
    identity = ModelIdentity.of(get_family("mdlm", MASK, V, shift=True), arch)
    assert identity.family_options == SHIFT and identity.hf_config_fields()["family_options"] == SHIFT
    meta = CheckpointMeta.from_dict(CheckpointMeta(3, identity).to_dict(), "ckpt")
    assert meta.identity == identity
    assert get_family("mdlm", MASK, V, **meta.identity.family_options).shift
    # an unshifted MDLM records nothing: its identity is the one written before the shift was recorded
    plain = ModelIdentity.of(get_family("mdlm", MASK, V), arch)
    assert plain.family_options == {} and "family_options" not in plain.hf_config_fields()
    assert not get_family("mdlm", MASK, V, **plain.family_options).shift
    # resuming a shifted checkpoint without --shift is refused; a --finetune may change it
    assert plain.differences(identity.as_dict()) == [
        "family_options: checkpoint {'shift': True} vs this run {}"]
    assert plain.differences(identity.as_dict(), weights_only=True) == []


@pytest.mark.parametrize("mode", ["conditional", "joint"])
def test_lm_eval_likelihood_scores_the_shifted_logits(raw, world_of_one, mode):
    """lm-eval's Monte-Carlo NELBO of a shifted model: the family's bound on the shifted logits,
    draw for draw, as training's validation scores it."""
    from megatron_dllm.evaluation.likelihood import LikelihoodEstimator

    def draws(inf):
        return LikelihoodEstimator(inf, num_mc_samples=8, mode=mode, batch_size=4, seed=3).draws(PROMPTS[1], [8, 9, 10])

    got = draws(shifted(raw))
    assert torch.equal(got, draws(by_hand(raw)))
    assert not torch.allclose(got, draws(InferenceModel(raw, "mdlm", MASK, V, L, None, "hf")))


def test_a_shift_on_another_family_in_config_json_is_one_input_error():
    from megatron_dllm.hf.config_check import check_config

    identity = ModelIdentity("duo", 32, 2, 2, V, MASK, family_options=dict(SHIFT))
    with pytest.raises(InputError, match=r"^cfg: family_options \{'shift': True\} are not settings of family 'duo'$"):
        check_config({}, identity, "cfg")
    check_config({}, ModelIdentity("mdlm", 32, 2, 2, V, MASK, family_options=dict(SHIFT)), "cfg")
