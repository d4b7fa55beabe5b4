"""Family registry: `--family NAME` -> class."""
from megatron_dllm.errors import InputError
from megatron_dllm.families.ar import AR
from megatron_dllm.families.base import Family, ModelInput, Noise
from megatron_dllm.families.bd3lm import BD3LM
from megatron_dllm.families.duo import Duo
from megatron_dllm.families.esolm import EsoLM
from megatron_dllm.families.mdlm import MDLM

FAMILIES = {cls.name: cls for cls in (AR, MDLM, Duo, EsoLM, BD3LM)}


def get_family(name: str, mask_id: int, vocab_size: int, loss: str | None = None, **options) -> Family:
    """`options`: a family's own settings (BD3-LM: block_size, noise, sampling_eps_min/max; MDLM: shift)."""
    if name not in FAMILIES:
        raise InputError(f"--family {name!r} is not a known family; expected one of: "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[name](mask_id=mask_id, vocab_size=vocab_size, loss=loss, **options)


__all__ = ["FAMILIES", "Family", "ModelInput", "Noise", "get_family"]
