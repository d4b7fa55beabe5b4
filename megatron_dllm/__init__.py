"""megatron_dllm: Megatron-core pretraining of AR and discrete diffusion language models."""
import warnings

from megatron_dllm.lazy_imports import defer_megatron_jit_fuser

# megatron-core warns about its own defaults (its fallback warnings on CPU: see platform.py).
warnings.filterwarnings("ignore", message="full scope is deprecated")
defer_megatron_jit_fuser()  # before anything imports megatron-core (see lazy_imports.py)
