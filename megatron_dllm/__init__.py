"""megatron_dllm: Megatron-core pretraining of AR and discrete diffusion language models."""
import warnings

# megatron-core 0.16 warns about its own defaults on every TransformerConfig; nothing to act on.
warnings.filterwarnings("ignore", message="full scope is deprecated")
