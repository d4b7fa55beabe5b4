"""Generation for every family (`generate`, `decode`) from one `InferenceModel` (`loading.py`).

Each family's sampler lives in its own file (ar.py, mdlm.py, duo.py, esolm.py) and is reached
through the family's `sampler()` hook; categorical.py holds the shared float64 sampling.
"""
from megatron_dllm.sampling.config import PREDICTORS, SamplingConfig
from megatron_dllm.sampling.generate import decode, generate
from megatron_dllm.sampling.loading import InferenceModel, load_inference_model

__all__ = ["PREDICTORS", "InferenceModel", "SamplingConfig", "decode", "generate", "load_inference_model"]
