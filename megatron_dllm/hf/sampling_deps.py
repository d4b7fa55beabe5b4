"""`deps.py` of an HF export: what its sampler files (megatron_dllm/sampling/*.py, shipped flat beside
modeling_dllm.py) take from outside sampling/, here from the export's own files, so that they run
where megatron_dllm is not installed. megatron_dllm's `sampling/deps.py` gives the same names from
the package. Self-contained: torch and the export's files only (see remote_code.py); the noise
schedule and the uniform-state noise are the package's own (families/schedules.py, model/constants.py and
families/uniform.py, shipped flat too).
"""
from .constants import T_EPS
from .errors import InputError
from .modeling_dllm import KVCache
from .schedules import LogLinear
from .seeding import seed_for
from .shift import shift_right
from .uniform import num_real, real_ids

__all__ = ["InputError", "KVCache", "get_family", "real_ids", "seed_for", "shift_right"]


IN_BLOCK = {"mask": "mdlm", "uniform": "duo"}  # BD3-LM's --noise: the family inside a block


class SamplingFamily:
    """What the samplers read of a family: its schedule, V, the ids a token can take, and whether
    its logits are shifted (MDLM's `shift`); BD3-LM also its block size, its in-block noise and that
    noise's family (`inner`)."""

    def __init__(self, name: str, mask_id: int, vocab_size: int, block_size: int | None = None,
                 noise: str | None = None, shift: bool = False):
        self.name, self.mask_id, self.vocab_size, self.shift = name, mask_id, vocab_size, shift
        self.schedule = LogLinear(T_EPS)  # every family's schedule (config.json's "loglinear")
        self.num_real = num_real(mask_id, vocab_size)
        if block_size is not None:
            if noise not in IN_BLOCK:
                raise ValueError(f"config.json: family_options noise {noise!r}: expected one of {', '.join(IN_BLOCK)}")
            self.block_size, self.noise = block_size, noise
            self.inner = SamplingFamily(IN_BLOCK[noise], mask_id, vocab_size)


def get_family(name: str, mask_id: int, vocab_size: int, **options) -> SamplingFamily:
    return SamplingFamily(name, mask_id, vocab_size, **options)
