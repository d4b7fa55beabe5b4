"""Which sampler generates for which family: the one place that ties the two together.

Families (`megatron_dllm/families`) hold the forward process and the losses and know nothing of
sampling; a family's sampler is one file here and one entry in `SAMPLERS`.
"""
from __future__ import annotations

from .ar import ARSampler
from .base import Sampler
from .bd3lm import BD3LMSampler
from .config import REMASKING_PREDICTORS, SamplingConfig
from .deps import InputError
from .duo import DuoSampler
from .esolm import EsoLMSampler
from .mdlm import MDLMSampler
from .remasking import remasking_sampler

SAMPLERS: dict[str, type[Sampler]] = {"ar": ARSampler, "mdlm": MDLMSampler, "duo": DuoSampler,
                                      "esolm": EsoLMSampler, "bd3lm": BD3LMSampler}


def get_sampler(inf, cfg: SamplingConfig) -> Sampler:
    """The sampler of the InferenceModel's family with these settings; `sample(prompt, generator)`
    generates one batch. An unknown family, or a predictor the family lacks, is a ValueError."""
    if inf.family not in SAMPLERS:
        raise InputError(f"--family {inf.family!r} has no sampler; expected one of: {', '.join(SAMPLERS)}")
    family = inf.make_family()
    if cfg.predictor in REMASKING_PREDICTORS:  # shared by the families it applies to (remasking.py)
        return remasking_sampler(family, inf, cfg)
    return SAMPLERS[inf.family](family, inf, cfg)


def steps_taken(cfg: SamplingConfig) -> int | None:
    """`cfg.steps` where it sets the number of denoising steps, else None (left to right takes one
    per token; threshold, entropy-bound and --tokens-per-step decide it themselves): what a record
    states as T. AR keeps its `steps`, the one point a Pareto fit takes of it."""
    if cfg.predictor in ("left-to-right", "threshold", "entropy-bound") or cfg.tokens_per_step is not None:
        return None
    return cfg.steps
