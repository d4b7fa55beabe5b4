"""Settings of one generation run (the Python API and tools/sample.py share them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .approx_kv_cache import MODES as APPROX_KV_CACHES
from .deps import InputError

PREDICTORS = ("ancestral", "block", "left-to-right")


@dataclass
class SamplingConfig:
    steps: int = 128               # T: denoising steps (ignored by AR and left-to-right: one per token)
    seq_length: Optional[int] = None  # L, prompt included (default: the model's training context)
    top_p: float = 1.0             # nucleus on the denoiser's / next-token distribution
    temperature: float = 1.0       # logits are divided by it before the softmax
    float64: bool = True           # categorical sampling in float64 (False: float32)
    predictor: str = "ancestral"   # "ancestral" = the family's default sampler
    kv_cache: bool = True          # AR/Eso-LM KV cache, MDLM no-change cache; Duo has no cache (time input)
    # left-to-right samplers stop once every row has emitted EOS (rest filled with EOS); off by
    # default: the paper's samples always run the full length, and stopping lowers AR's entropy
    stop_at_eos: bool = False
    eos_id: Optional[int] = None   # default: the tokenizer's EOD
    # MDLM/Duo block-wise decoding: the generated positions in blocks of this many, one after the
    # other, `steps` steps each (None: one block, the family's own sampler)
    block_length: Optional[int] = None
    # MDLM/Duo approximate KV caches refreshed per block (Fast-dLLM): none (exact) | prefix | dual
    approx_kv_cache: str = "none"

    def check(self) -> None:
        """Family-independent checks; each family's sampler checks the rest."""
        if self.predictor not in PREDICTORS:
            raise InputError(f"--predictor {self.predictor!r} is unknown; valid: {', '.join(PREDICTORS)}")
        if self.steps < 1:
            raise InputError(f"--steps {self.steps}: must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.temperature <= 0:
            raise InputError(f"--temperature {self.temperature}: must be > 0")
        if self.block_length is not None and self.block_length < 1:
            raise InputError(f"--block-length {self.block_length}: must be >= 1")
        if self.approx_kv_cache not in APPROX_KV_CACHES:
            raise InputError(f"--approx-kv-cache {self.approx_kv_cache!r} is unknown; valid: "
                             f"{', '.join(APPROX_KV_CACHES)}")
        if self.seq_length is not None and self.seq_length < 2:
            raise InputError(f"--seq-length {self.seq_length}: must be >= 2")
