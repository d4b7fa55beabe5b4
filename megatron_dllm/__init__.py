"""megatron_dllm: Megatron-core pretraining of AR and discrete diffusion language models."""
import warnings

# megatron-core warns about its own defaults (its fallback warnings on CPU: see platform.py).
warnings.filterwarnings("ignore", message="full scope is deprecated")
