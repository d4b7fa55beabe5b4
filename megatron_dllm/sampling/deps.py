"""Everything the sampler files take from outside megatron_dllm/sampling/, in one place.

The sampler files import each other relatively and the rest of megatron_dllm only through this
module, so that every HF export ships them as its generation code: flat beside modeling_dllm.py,
where megatron_dllm need not be installed, with `hf/sampling_deps.py` as their `deps.py` (the same
names from the export's own files; `hf/remote_code.py` lists what an export ships). A new sampler
file keeps to this: relative imports, plus torch and the standard library.
"""
from megatron_dllm.errors import InputError
from megatron_dllm.families import get_family
from megatron_dllm.families.shift import shift_right
from megatron_dllm.families.uniform import real_ids
from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.seeding import seed_for

__all__ = ["InputError", "KVCache", "get_family", "real_ids", "seed_for", "shift_right"]
