"""Settings of one generation run (the Python API and tools/sample.py share them)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .approx_kv_cache import MODES as APPROX_KV_CACHES
from .deps import InputError

# predictors that commit the masked (MDLM) or not yet committed (Duo) positions a rule picks from
# the model's confidence, block by block (sampling/remasking.py)
REMASKING_PREDICTORS = ("low-confidence", "threshold", "entropy-bound")
PREDICTORS = ("ancestral", "block", "left-to-right") + REMASKING_PREDICTORS
NOISE_REMOVALS = ("greedy", "ancestral")
MIN_TEMPERATURE = 1e-30  # logits / 1e-30 stay finite in float32 up to |logit| ~ 3e8
DEFAULT_CONFIDENCE_THRESHOLD = 0.9  # Fast-dLLM's default
DEFAULT_ENTROPY_BOUND = 0.1         # gamma of the entropy-bounded sampler (diffusers' default)


@dataclass
class SamplingConfig:
    steps: int = 128               # T: denoising steps (ignored by AR and left-to-right: one per token)
    seq_length: Optional[int] = None  # L, prompt included (default: the model's training context)
    top_p: float = 1.0             # nucleus on the denoiser's / next-token distribution
    temperature: float = 1.0       # logits are divided by it before the softmax
    float64: bool = True           # categorical sampling in float64 (False: float32)
    predictor: str = "ancestral"   # "ancestral" = the family's default sampler
    kv_cache: bool = True          # AR/Eso-LM KV cache, MDLM no-change cache; Duo has no cache (time input)
    cuda_graphs: bool = False      # capture the denoiser's forwards as CUDA graphs (cuda_graphs.py; CUDA only)
    # left-to-right samplers stop once every row has emitted EOS (rest filled with EOS); off by
    # default: the paper's samples always run the full length, and stopping lowers AR's entropy
    stop_at_eos: bool = False
    eos_id: Optional[int] = None   # default: the tokenizer's EOD
    # block-wise decoding and the remasking predictors (None: not given; each knob only with its predictors)
    # generated positions per block, decoded left to right (None: one block). `steps` counts per block
    # with ancestral (the paper's T per block) and in total, spread over the blocks, with low-confidence (LLaDA's)
    block_length: Optional[int] = None
    tokens_per_step: Optional[int] = None  # low-confidence: commit k per step (default: from --steps)
    confidence_threshold: Optional[float] = None  # threshold: commit every p(x0) > tau (at least one)
    entropy_bound: Optional[float] = None  # entropy-bound: gamma (at least one per step)
    # MDLM/Duo ancestral block-wise decoding: Fast-dLLM's approximate KV caches refreshed per block
    approx_kv_cache: str = "none"  # none (exact) | prefix | dual
    # block decoding (BD3-LM): generate at most this many tokens after the prompt (default: up to L)
    max_new_tokens: Optional[int] = None
    # MDLM/Duo ancestral: the final step at t = 1e-5, the denoiser's argmax ("greedy": Duo's greedy
    # tail) or one more ancestral step to alpha_s = 1 ("ancestral": the paper code's config default)
    noise_removal: str = "greedy"

    def check(self) -> None:
        """Family-independent checks; each family's sampler checks the rest."""
        if self.predictor not in PREDICTORS:
            raise InputError(f"--predictor {self.predictor!r} is unknown; valid: {', '.join(PREDICTORS)}")
        if self.steps < 1:
            raise InputError(f"--steps {self.steps}: must be >= 1")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            raise InputError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not MIN_TEMPERATURE <= self.temperature < math.inf:  # below it, logits / temperature can overflow
            raise InputError(f"--temperature {self.temperature}: must be a finite number >= {MIN_TEMPERATURE:g} "
                             f"(for the argmax, --top-p near 0)")
        if self.approx_kv_cache not in APPROX_KV_CACHES:
            raise InputError(f"--approx-kv-cache {self.approx_kv_cache!r} is unknown; valid: "
                             f"{', '.join(APPROX_KV_CACHES)}")
        if self.noise_removal not in NOISE_REMOVALS:
            raise InputError(f"--noise-removal {self.noise_removal!r} is unknown; valid: {', '.join(NOISE_REMOVALS)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.seq_length is not None and self.seq_length < 2:
            raise InputError(f"--seq-length {self.seq_length}: must be >= 2")
        self.check_remasking()

    def check_remasking(self, name=None, sep: str = " ") -> None:
        """Each block, cache and remasking knob is valid and given only with the predictors it
        belongs to. Messages name a field as `name(field)` followed by `sep` and its value (default:
        the flags, `--block-length 0`; the HF export's `generate` spells its keyword arguments)."""
        name = name or (lambda field: "--" + field.replace("_", "-"))
        predictor = name("predictor") + sep
        remasking = "|".join(REMASKING_PREDICTORS)
        knobs = (("block_length", ("ancestral",) + REMASKING_PREDICTORS, f"{predictor}ancestral|{remasking}"),
                 ("approx_kv_cache", ("ancestral",), predictor + "ancestral"),
                 ("tokens_per_step", ("low-confidence",), predictor + "low-confidence"),
                 ("confidence_threshold", ("threshold",), predictor + "threshold"),
                 ("entropy_bound", ("entropy-bound",), predictor + "entropy-bound"))
        for field, owners, spelled in knobs:
            if getattr(self, field) not in (None, "none") and self.predictor not in owners:
                raise InputError(f"{name(field)} applies to {spelled} only, not {predictor}{self.predictor}")
        for field in ("block_length", "tokens_per_step"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise InputError(f"{name(field)}{sep}{value}: must be >= 1")
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise InputError(f"{name('confidence_threshold')}{sep}{self.confidence_threshold}: must be in [0, 1]")
        if self.entropy_bound is not None and not 0.0 <= self.entropy_bound < float("inf"):
            raise InputError(f"{name('entropy_bound')}{sep}{self.entropy_bound}: must be a finite number >= 0")

    @property
    def threshold(self) -> float:
        return DEFAULT_CONFIDENCE_THRESHOLD if self.confidence_threshold is None else self.confidence_threshold

    @property
    def gamma(self) -> float:
        return DEFAULT_ENTROPY_BOUND if self.entropy_bound is None else self.entropy_bound
