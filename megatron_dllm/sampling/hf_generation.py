"""`generate` (Dream's name: `diffusion_generate`) of the diffusion families' transformers model
(`DLLMForMaskedLM` in modeling_dllm.py): this project's own samplers behind transformers' calling
convention. Every HF export ships this file and the sampler files beside its modeling_dllm.py (they
import each other relatively, see deps.py), so an export loaded with
`AutoModelForMaskedLM.from_pretrained(dir, trust_remote_code=True)` samples offline without
megatron_dllm, and exactly as megatron_dllm does:

    model.generate(num_return_sequences=4, max_new_tokens=1024, steps=256, seed=0)
        == sampling.generate(inf, SamplingConfig(steps=256, seq_length=1024), num_samples=4, seed=0)
    model.generate(prompt_ids, max_new_tokens=64, steps=64, seed=0)       # one prompt length
        == sampling.generate(inf, SamplingConfig(steps=64, seq_length=P + 64), num_samples=b, seed=0,
                             prompt_ids=prompt_ids)
    model.generate(padded_ids, attention_mask=mask, max_new_tokens=64, steps=64, seed=0)
        row i == conditional.generate_native(inf, prompt_i, 64, eos_id, steps=64, seed=0)
    model.generate(..., sampler="low-confidence", block_length=16)   # MDLM/Duo remasking: the same,
        with SamplingConfig(predictor="low-confidence", block_length=16) / generate_native(..., same)

The first two return [rows, P + max_new_tokens]: the prompt, then the filled canvas (the sample
command's samples). With `attention_mask` (marking padding, left or right, or none: the protocol
never depends on whether a batch happens to hold padding), each row is its prompt (the unmasked
tokens) answered by conditional generation (`sampling.conditional`'s batched
protocol: cut after the first EOS); the result is the input as given, then each row's answer,
filled with `eos_token_id` after it (with conditional's settings: stop at EOS, caches on,
float64; `float64=False`, `kv_cache=False`, `cuda_graphs=True` and `generator=` are refused
there). `generator=` replaces the seeded random stream of unpadded input; padded rows each draw
from their own seeded stream, as batch 1 would: a prompt's j-th of `num_return_sequences`
samples from `seed + j`.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import re

import torch

# transformers copies an export's remote-code files by their `from .name import` lines only; the
# samplers import categorical as a module (`from . import categorical`), so it is named here
from .categorical import sample as _shipped_with_the_export  # noqa: F401
from .conditional import generate_left_to_right_batch, generate_native_batch
from .config import MIN_TEMPERATURE, NOISE_REMOVALS, REMASKING_PREDICTORS, SamplingConfig
from .deps import get_family
from .generate import generate
from .inference_model import InferenceModel
from .registry import SAMPLERS
from .remasking import REMASKING_SAMPLERS

SCHEDULE = "loglinear"  # the samplers' noise schedule (config.json's noise_schedule)
# generate's keyword argument for each SamplingConfig field it spells differently (Fast-dLLM's `threshold`)
ARGUMENT = {"predictor": "sampler", "confidence_threshold": "threshold"}
# the samplers' messages name the sample command's flags: generate's caller reads its own arguments
_FLAG_ARGUMENTS = {"--steps": "steps", "--predictor": "sampler", "--max-new-tokens": "max_new_tokens",
                   "--block-length": "block_length", "--tokens-per-step": "tokens_per_step",
                   "--confidence-threshold": "threshold", "--entropy-bound": "entropy_bound",
                   "--kv-cache": "kv_cache", "--no-kv-cache": "kv_cache=False", "--cuda-graphs": "cuda_graphs",
                   "--top-p": "top_p", "--temperature": "temperature", "--stop-at-eos": "stop_at_eos",
                   "--noise-removal": "noise_removal", "--family": "family", "prompt_ids": "input_ids"}


@contextlib.contextmanager
def _named_as_arguments():
    """A sampler's ValueError, its flags named as generate's keyword arguments."""
    try:
        yield
    except ValueError as err:
        raise ValueError(re.sub(r"--[a-z0-9-]+|prompt_ids", lambda m: _FLAG_ARGUMENTS.get(m[0], m[0]), str(err))) \
            from None


def _predictors(family: str) -> tuple[str, ...]:
    own = SAMPLERS[family].predictors
    return own + (REMASKING_PREDICTORS if family in REMASKING_SAMPLERS else ())


def _family_options(config) -> dict:
    """The family's own settings from config.json (BD3-LM: block_size, noise)."""
    return dict(getattr(config, "family_options", None) or {})


def _checked(model, sampler: str, steps: int, max_new_tokens: int | None, num_return_sequences: int,
             temperature: float, top_p: float, options: dict) -> None:
    config = model.config
    if config.family not in SAMPLERS:
        raise ValueError(f"config.json: family {config.family!r} has no sampler; expected one of: "
                         f"{', '.join(SAMPLERS)}")
    family = get_family(config.family, config.mask_token_id, config.vocab_size, **_family_options(config))
    eps = float(family.schedule.alpha(torch.tensor(1.0, dtype=torch.float64)))  # log-linear: alpha_1 = eps
    if config.noise_schedule != SCHEDULE or abs(config.noise_eps - eps) > 1e-12:
        raise ValueError(f"config.json: noise_schedule {config.noise_schedule!r} with noise_eps {config.noise_eps}; "
                         f"the samplers' schedule is {SCHEDULE!r} with eps {eps}")
    valid = _predictors(config.family)
    if sampler not in valid:
        raise ValueError(f"sampler={sampler!r} is not available for the {config.family} family; valid: "
                         f"{', '.join(valid)}")
    for name, value in (("steps", steps), ("max_new_tokens", max_new_tokens),
                        ("num_return_sequences", num_return_sequences), ("block_length", options["block_length"]),
                        ("tokens_per_step", options["tokens_per_step"])):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1]")
    if not MIN_TEMPERATURE <= temperature < math.inf:  # below it, logits / temperature can overflow
        raise ValueError(f"temperature={temperature!r}: must be a finite number >= {MIN_TEMPERATURE:g}")
    SamplingConfig(predictor=sampler, **options).check_remasking(lambda field: ARGUMENT.get(field, field), "=")
    removal = options["noise_removal"]
    if removal not in NOISE_REMOVALS or (removal != "greedy" and sampler != "ancestral"):
        raise ValueError(f"noise_removal={removal!r}: 'greedy', or 'ancestral' with sampler='ancestral'")


@_named_as_arguments()
def diffusion_generate(model, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                       max_new_tokens: int | None = None, steps: int = SamplingConfig.steps,
                       sampler: str = SamplingConfig.predictor, seed: int = 0,
                       generator: torch.Generator | None = None, temperature: float = SamplingConfig.temperature,
                       top_p: float = SamplingConfig.top_p, num_return_sequences: int = 1,
                       eos_token_id: int | None = None, stop_at_eos: bool | None = None,
                       kv_cache: bool = SamplingConfig.kv_cache, float64: bool = SamplingConfig.float64,
                       cuda_graphs: bool = SamplingConfig.cuda_graphs,
                       block_length: int | None = None, tokens_per_step: int | None = None,
                       threshold: float | None = None, entropy_bound: float | None = None,
                       noise_removal: str = SamplingConfig.noise_removal) -> torch.LongTensor:
    """Samples [rows, P + new] from the family's sampler (see the module docstring).

    input_ids: [b, P] prompts (None or P = 0: unconditional, `num_return_sequences` rows).
    attention_mask: [b, P], 0 at padding: prompts of different lengths (conditional protocol).
    max_new_tokens: positions generated after the prompt (default: the rest of the model's context).
    steps, sampler ("ancestral"; "left-to-right"; Eso-LM also "block"; MDLM and Duo also the
    remasking "low-confidence", "threshold", "entropy-bound"), temperature, top_p, kv_cache,
    float64, stop_at_eos, cuda_graphs: as `SamplingConfig` (`--steps`, `--predictor`, ...).
    block_length, tokens_per_step, threshold, entropy_bound: the remasking predictors' knobs, as
    `SamplingConfig`'s (`--block-length`, `--tokens-per-step`, `--confidence-threshold`,
    `--entropy-bound`); each only with its sampler.
    noise_removal: "greedy" or "ancestral", the final step of the MDLM/Duo/BD3-LM ancestral samplers
    (`--noise-removal`).
    seed: the seed of megatron_dllm's sample command; generator: draw from this one instead.
    num_return_sequences: samples per prompt (rows of a prompt follow each other).
    eos_token_id: the EOS id, one (default: generation_config.eos_token_id, else config's).
    """
    options = dict(block_length=block_length, tokens_per_step=tokens_per_step, confidence_threshold=threshold,
                     entropy_bound=entropy_bound, noise_removal=noise_removal)  # SamplingConfig's fields
    _checked(model, sampler, steps, max_new_tokens, num_return_sequences, temperature, top_p, options)
    config = model.config
    inf = InferenceModel(model, config.family, config.mask_token_id, config.vocab_size,
                         config.max_position_embeddings, None, "hf", family_options=_family_options(config))
    eos = _one_id(eos_token_id if eos_token_id is not None else getattr(
        getattr(model, "generation_config", None) or config, "eos_token_id", None))
    if input_ids is None:
        input_ids = torch.zeros(num_return_sequences, 0, dtype=torch.long)
        num_return_sequences = 1
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).to(inf.device)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [batch, prompt length], got shape {tuple(input_ids.shape)}")
    input_ids = input_ids.repeat_interleave(num_return_sequences, dim=0)
    if attention_mask is not None and input_ids.shape[1]:  # (an empty prompt is unconditional generation)
        attention_mask = torch.as_tensor(attention_mask).to(inf.device).repeat_interleave(num_return_sequences, 0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}")
        # always the conditional protocol, padding or not: a row's answer never depends on whether
        # another prompt of the batch happens to be shorter
        real = attention_mask.bool()
        changed = {"generator=": generator is not None, "float64=False": not float64,
                   "kv_cache=False": not kv_cache, "cuda_graphs=True": cuda_graphs,
                   "stop_at_eos=False": stop_at_eos is False}
        if any(changed.values()):
            raise ValueError(f"{', '.join(k for k, v in changed.items() if v)}: prompts given with an attention_mask "
                             f"are answered with conditional generation's own settings (rows seeded from seed, "
                             f"float64, KV caches, no CUDA graphs)")
        if not bool(real.any(1).all()):
            empty = int((~real.any(1)).nonzero()[0, 0]) // num_return_sequences
            raise ValueError(f"attention_mask: row {empty} marks no token; each prompt needs at least one")
        longest = int(real.sum(1).max())
        if max_new_tokens is not None and longest + max_new_tokens > inf.seq_length:
            raise ValueError(f"input_ids: a prompt of {longest} tokens and max_new_tokens={max_new_tokens} do "
                             f"not fit the model's context of {inf.seq_length}")
        seeds = [seed + j for _ in range(len(input_ids) // num_return_sequences)
                 for j in range(num_return_sequences)]  # a prompt's samples differ
        return _conditional(inf, input_ids, real, max_new_tokens, eos, sampler, steps, seeds,
                            temperature, top_p, options)
    prompt = input_ids.shape[1]
    room = inf.seq_length - prompt
    if room < 1 or (max_new_tokens or 0) > room:
        raise ValueError(f"input_ids: a prompt of {prompt} tokens and max_new_tokens={max_new_tokens} do not fit "
                         f"the model's context of {inf.seq_length}")
    cfg = SamplingConfig(steps=steps, seq_length=prompt + (max_new_tokens or room), top_p=top_p,
                         temperature=temperature, float64=float64, predictor=sampler, kv_cache=kv_cache,
                         cuda_graphs=cuda_graphs, stop_at_eos=bool(stop_at_eos), eos_id=eos, **options)
    out = generate(inf, cfg, num_samples=input_ids.shape[0], seed=seed, prompt_ids=input_ids if prompt else None,
                   generator=generator)
    return out.to(inf.device)


def _one_id(eos_token_id) -> int | None:
    """The EOS id of an int, a one-element list or tensor (as transformers' configs hold it), or None."""
    ids = eos_token_id.flatten().tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    if len(ids) != 1 or not (ids[0] is None or isinstance(ids[0], numbers.Integral)) or isinstance(ids[0], bool):
        raise ValueError(f"eos_token_id={eos_token_id!r}: expected one token id (these samplers stop at one EOS)")
    return None if ids[0] is None else int(ids[0])


def _conditional(inf, input_ids, real, max_new_tokens, eos, sampler, steps, seeds, temperature, top_p,
                 options: dict) -> torch.Tensor:
    """Conditional generation for prompts given with a mask (`real` False at padding), row i drawing
    from `seeds[i]`: the input, then each row's answer (cut after its first EOS), EOS-filled to
    the longest."""
    if eos is None:
        raise ValueError("prompts given with an attention_mask are answered up to EOS: give eos_token_id")
    prompts = [row[keep].tolist() for row, keep in zip(input_ids, real)]
    settings = dict(greedy=False, temperature=temperature, top_p=top_p, seeds=seeds)
    if sampler == "left-to-right":
        answers = generate_left_to_right_batch(inf, prompts, max_new_tokens, eos, **settings)
    else:  # the family's sampler refuses what it lacks
        answers = generate_native_batch(inf, prompts, max_new_tokens, eos, steps=steps, predictor=sampler,
                                        **settings, **options)
    out = torch.full((len(prompts), input_ids.shape[1] + max(map(len, answers))), eos, dtype=torch.long,
                     device=input_ids.device)
    out[:, :input_ids.shape[1]] = input_ids
    for row, answer in zip(out, answers):
        row[input_ids.shape[1]:input_ids.shape[1] + len(answer)] = torch.tensor(answer, dtype=torch.long)
    return out
