"""megatron_dllm: Megatron-core pretraining of AR and discrete diffusion language models."""
import warnings

from megatron_dllm.lazy_imports import defer_megatron_jit_fuser

# megatron-core warns about its own defaults (its fallback warnings on CPU: see platform.py), and
# torch about the APIs megatron-core 0.16 calls (checkpoint loading, sequence-parallel collectives):
# nothing a user of this package can act on.
warnings.filterwarnings("ignore", message="full scope is deprecated")
warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                        r"deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)  # megatron-core's SwiGLU checkpoint factory
defer_megatron_jit_fuser()  # before anything imports megatron-core (see lazy_imports.py)
