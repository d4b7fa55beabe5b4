"""Generation for every family (`generate`, `decode`) from one `InferenceModel` (`loading.py`).

Each family's sampler lives in its own file (ar.py, mdlm.py, duo.py, esolm.py, bd3lm.py) and is reached
through `registry.py` (`get_sampler`); categorical.py holds the shared float64 sampling.
"""
from megatron_dllm.sampling.config import PREDICTORS, SamplingConfig
from megatron_dllm.sampling.generate import decode, generate
from megatron_dllm.sampling.loading import InferenceModel, load_inference_model
from megatron_dllm.sampling.registry import SAMPLERS, get_sampler

__all__ = ["PREDICTORS", "SAMPLERS", "InferenceModel", "SamplingConfig", "decode", "generate", "get_sampler",
           "load_inference_model"]
