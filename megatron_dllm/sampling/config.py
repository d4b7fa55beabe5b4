"""Settings of one generation run (the Python API and tools/sample.py share them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dllm.errors import InputError

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
    # block decoding (BD3-LM): generate at most this many tokens after the prompt (default: up to L)
    max_new_tokens: Optional[int] = None

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
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.seq_length is not None and self.seq_length < 2:
            raise InputError(f"--seq-length {self.seq_length}: must be >= 2")
