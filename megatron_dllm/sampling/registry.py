"""Which sampler generates for which family: the one place that ties the two together.

Families (`megatron_dllm/families`) hold the forward process and the losses and know nothing of
sampling; a family's sampler is one file here and one entry in `SAMPLERS`.
"""
from __future__ import annotations

from megatron_dllm.errors import InputError
from megatron_dllm.sampling.ar import ARSampler
from megatron_dllm.sampling.base import Sampler
from megatron_dllm.sampling.bd3lm import BD3LMSampler
from megatron_dllm.sampling.config import SamplingConfig
from megatron_dllm.sampling.duo import DuoSampler
from megatron_dllm.sampling.esolm import EsoLMSampler
from megatron_dllm.sampling.mdlm import MDLMSampler

SAMPLERS: dict[str, type[Sampler]] = {"ar": ARSampler, "mdlm": MDLMSampler, "duo": DuoSampler,
                                      "esolm": EsoLMSampler, "bd3lm": BD3LMSampler}


def get_sampler(inf, cfg: SamplingConfig) -> Sampler:
    """The sampler of the InferenceModel's family with these settings; `sample(prompt, generator)`
    generates one batch. An unknown family, or a predictor the family lacks, is a ValueError."""
    if inf.family not in SAMPLERS:
        raise InputError(f"--family {inf.family!r} has no sampler; expected one of: {', '.join(SAMPLERS)}")
    family = inf.make_family()
    return SAMPLERS[inf.family](family, inf, cfg)
