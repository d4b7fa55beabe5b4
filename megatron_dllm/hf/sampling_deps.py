"""`deps.py` of an HF export: what its sampler files (megatron_dllm/sampling/*.py, shipped flat beside
modeling_dllm.py) take from outside sampling/, here from the export's own files, so that they run
where megatron_dllm is not installed. megatron_dllm's `sampling/deps.py` gives the same names from
the package. Self-contained: torch and the export's files only (see remote_code.py); the noise
schedule is the package's own (families/schedules.py and model/constants.py, shipped flat too).
"""
from .constants import T_EPS
from .errors import InputError
from .modeling_dllm import KVCache
from .schedules import LogLinear
from .seeding import seed_for

__all__ = ["InputError", "KVCache", "get_family", "seed_for"]


class SamplingFamily:
    """What the samplers read of a family: its schedule, and V, the ids a token can take."""

    def __init__(self, name: str, mask_id: int, vocab_size: int):
        self.name, self.mask_id, self.vocab_size = name, mask_id, vocab_size
        self.schedule = LogLinear(T_EPS)  # every family's schedule (config.json's "loglinear")
        self.num_real = vocab_size - (1 if 0 <= mask_id < vocab_size else 0)


def get_family(name: str, mask_id: int, vocab_size: int, **options) -> SamplingFamily:
    if options:  # BD3-LM's block size and in-block noise: its sampler needs megatron_dllm's family
        raise ValueError(f"generate() on a {name} export is not supported yet; sample it with megatron_dllm's "
                         f"tools/sample.py --load EXPORT_DIR")
    return SamplingFamily(name, mask_id, vocab_size)
