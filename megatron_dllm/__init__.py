"""megatron_dllm: Megatron-core pretraining of AR and discrete diffusion language models."""
import warnings

# megatron-core announces its fallbacks when TransformerEngine/apex are absent (always on CPU;
# the run's log line names the layer implementation in use) and warns about its own defaults.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")
