"""The lm-evaluation-harness model class of this project, registered as `megatron_dllm`.

    lm_eval --model megatron_dllm --model_args load=CKPT|HF_DIR,num_mc_samples=64,likelihood_mode=conditional
    (after `import megatron_dllm.evaluation.lm_eval_model`; `tools/evaluate.py downstream` does it)

It loads a megatron checkpoint (any TP/PP layout, resharded to one device) or an exported HF
directory through `sampling.loading`, for every family whose bound scores a sequence of any length
(BD3-LM's needs whole blocks: refused at load), and scores requests with
`evaluation.likelihood.LikelihoodEstimator` (AR exact; MDLM, Duo, Eso-LM a Monte-Carlo NELBO,
`conditional` or `joint` mode, see there). Tokenisation is lm-eval's own (`TemplateLM`: the
context's trailing spaces move to the continuation; the pair is encoded whole and split), with
the model's tokenizer and no special tokens, so an AR model scores as lm-eval's `hf` backend
scores its HF export, except that here the [MASK] logit is excluded from the softmax, as in the
AR training loss (the `hf` backend keeps it: about 1e-3 nats per request apart). An empty
context is replaced by one EOD token: documents in the training data start right after an EOD
and never with a BOS (the export's tokenizer names the EOD its BOS, so the `hf` backend prefixes
empty contexts and rolling windows alike).

- `loglikelihood`: (ll, is_greedy); the standard errors of the diffusion estimates are kept in
  `self.stderrs` (one per request, in order) and `self.stderrs_by_task` for the results.
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows of the model's context, each
  scored as (continuation | clean context) and summed (AR: the exact log-likelihood; diffusion:
  a sum of conditional bounds, whatever `likelihood_mode`, since a joint per-token mean does not add up).
- `generate_until`: batched left-to-right generation, `batch_size` requests per call ('auto': 8 on
  CPU, on a GPU the largest that fits), see `evaluation/generate_until.py`. Another sampler:
  `generation_predictor=low-confidence,generation_steps=64,block_length=32` (any `--predictor`
  with its knobs `block_length`, `tokens_per_step`, `confidence_threshold`, `entropy_bound`;
  ancestral MDLM/Duo with `block_length` also `approx_kv_cache=prefix|dual`, Fast-dLLM's approximate caches).
"""
from __future__ import annotations

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from megatron_dllm.errors import InputError
from megatron_dllm.evaluation.likelihood import LikelihoodEstimator
from megatron_dllm.families import FAMILIES


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise InputError(f"--model_args {name}={value}: expected true or false")


@register_model("megatron_dllm")
class MegatronDLLM(TemplateLM):
    backend = "causal"  # lm-eval encodes context + continuation together and splits them

    def __init__(self, load: str, num_mc_samples: int = 64, likelihood_mode: str = "conditional",
                 batch_size: int | str = 64, seed: int = 1234, dtype: str = "float32", device: str | None = None,
                 use_ema: bool | str = False, tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                 max_gen_toks: int = 256, inference_model=None, generation_predictor: str = "left-to-right",
                 generation_steps: int = 64, block_length: int | None = None, tokens_per_step: int | None = None,
                 confidence_threshold: float | None = None, entropy_bound: float | None = None,
                 approx_kv_cache: str = "none",
                 # passed by lm-eval (simple_evaluate; its CLI's --trust_remote_code), not needed here
                 max_batch_size: int | None = None, trust_remote_code: bool | str = False, **unknown):
        super().__init__()
        if unknown:  # a misspelt model_arg must not leave its default silently in force
            import inspect

            known = [p for p in inspect.signature(MegatronDLLM).parameters
                     if p not in ("unknown", "inference_model", "max_batch_size", "trust_remote_code")]
            raise InputError(f"--model_args {', '.join(unknown)}: unknown; expected some of {', '.join(known)}")
        from megatron.core import parallel_state

        from megatron_dllm import platform
        from megatron_dllm.sampling.loading import load_inference_model

        if not parallel_state.model_parallel_is_initialized():
            platform.init_distributed(1, 1)  # the family bounds run on megatron's vocab-parallel layout
        if inference_model is None:
            if dtype not in ("float32", "bfloat16", "float16", "float64"):
                raise InputError(f"--model_args dtype={dtype}: expected float32, bfloat16, float16 or float64")
            inference_model = load_inference_model(load, platform.tool_device(device), getattr(torch, dtype),
                                                   _flag(use_ema, "use_ema"), tokenizer_type, tokenizer_model)
        self.inference_model = inference_model
        why = FAMILIES[inference_model.family].any_length_refusal  # lm-eval's requests have any length
        if why is not None:
            scorable = [name for name, family in FAMILIES.items() if family.any_length_refusal is None]
            raise InputError(f"--load {load}: lm-eval scoring of --family {inference_model.family} is not "
                             f"supported ({why}); {', '.join(scorable)} models are")
        if self.inference_model.tokenizer is None:
            raise InputError(f"--load {load}: no tokenizer (give tokenizer_type and tokenizer_model in --model_args)")
        self.tok = self.inference_model.tokenizer
        batch = 64 if str(batch_size).startswith("auto") else int(batch_size)
        self.estimator = LikelihoodEstimator(self.inference_model, int(num_mc_samples), likelihood_mode, batch,
                                             int(seed))
        self.max_gen_toks = int(max_gen_toks)
        self.generation_batch_size = "auto" if str(batch_size).startswith("auto") else batch  # generate_until
        self.seed = int(seed)
        self.generation = self._generation(generation_predictor, generation_steps, block_length, tokens_per_step,
                                           confidence_threshold, entropy_bound, approx_kv_cache)
        if self.generation["predictor"] != "left-to-right":  # refused now, not after the likelihood tasks ran
            from megatron_dllm.sampling.config import SamplingConfig
            from megatron_dllm.sampling.registry import get_sampler

            get_sampler(self.inference_model, SamplingConfig(**self.generation))
        self.stderrs: list[float] = []  # one per scored request, in order
        self.stderrs_by_task: dict[str, list[float]] = {}

    @staticmethod
    def _generation(predictor, steps, block_length, tokens_per_step, confidence_threshold, entropy_bound,
                    approx_kv_cache) -> dict:
        """generate_until's sampler: left to right, or native with `SamplingConfig` fields (checked here)."""
        from megatron_dllm.sampling.config import SamplingConfig

        def number(cast, value):
            return None if value is None else cast(value)

        options = {"predictor": str(predictor), "steps": int(steps), "block_length": number(int, block_length),
                   "tokens_per_step": number(int, tokens_per_step),
                   "confidence_threshold": number(float, confidence_threshold),
                   "entropy_bound": number(float, entropy_bound), "approx_kv_cache": str(approx_kv_cache)}
        SamplingConfig(**options).check()
        return options

    # ------------------------------------------------------------------ TemplateLM surface

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self.inference_model.seq_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tok.tokenize(string))

    def tok_decode(self, tokens) -> str:
        return self.tok.detokenize(list(tokens))

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        first = len(self.stderrs)
        self.task_of = {request.args: getattr(request, "task_name", None) for request in requests}  # for errors
        out = super().loglikelihood(requests, disable_tqdm)
        for request, stderr in zip(requests, self.stderrs[first:]):
            self.stderrs_by_task.setdefault(getattr(request, "task_name", None) or "", []).append(stderr)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        for key, _, cont in requests:  # all before any is scored: not after an hour of the others
            if len(cont) > self.max_length:
                task, text = getattr(self, "task_of", {}).get(key), key[1][:40] if key else ""
                raise InputError(f"loglikelihood{f' (task {task})' if task else ''}: a continuation of {len(cont)} "
                                 f"tokens ({text!r}...) exceeds the model's context {self.max_length}; a longer one "
                                 f"cannot be scored")
        out = []
        step = max(1, self.estimator.batch_size if self.estimator.family.next_token else 1)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood") as bar:
            for first in range(0, len(requests), step):
                chunk = requests[first:first + step]
                scores = self.estimator.score([(ctx, cont) for _, ctx, cont in chunk])
                for (key, _, _), score in zip(chunk, scores):
                    out.append((score.ll, score.greedy))
                    self.stderrs.append(score.stderr)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, (score.ll, score.greedy))
                bar.update(len(chunk))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        joint = self.estimator.mode
        self.estimator.mode = "conditional"  # bounds of consecutive windows add up; joint means do not
        try:
            out = []
            for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="loglikelihood_rolling"):
                windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                scores = self.estimator.score(windows)
                self.stderrs.append(float(sum(s.stderr ** 2 for s in scores) ** 0.5))
                ll = sum(s.ll for s in scores)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), ll)
                out.append(ll)
            return out
        finally:
            self.estimator.mode = joint

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from megatron_dllm.evaluation.generate_until import generate_until

        return generate_until(self, requests, disable_tqdm)
