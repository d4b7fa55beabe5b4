"""Validation NELBO / perplexity of a trained model on a dataset split (as in the paper's code, Validation PPL).

This is the trainer's validation (`Trainer.evaluate`) run outside the trainer:
- the same validation dataset, built by `training.inputs.prepare_inputs` from the same data flags
  (with no data flags, the embedded demo corpus's validation split, as pretrain_dllm.py);
- the same `BatchSchedule` over it with the validation seed stream `seed + 1` and the same
  global-batch strata, so t draw 0 is exactly the noise the training-time validation drew;
- each family's own evaluation bound, `family.nelbo` (MDLM and Eso-LM: the MDLM NELBO whatever
  their training loss; Duo: its closed-form NELBO; AR: exact NLL), on the logits of the
  plain-PyTorch model that `sampling.loading` builds from a checkpoint or an HF directory.
With one t draw per sequence the figure therefore equals the `valid_nelbo` the trainer logged
for the same data, --seed, --global-batch-size and --eval-iters (the micro-batch size only
changes how the work is split). Draw k >= 1 of `--num-t-draws K` uses a seed stream of its own.

Aggregation: Σ nll / Σ tokens in float64 over all batches and draws (token-weighted, not a mean
of batch means); ppl = exp(nelbo), bpd = nelbo / ln 2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from megatron_dllm.config.data import DataConfig, TokenizerConfig
from megatron_dllm.errors import InputError
from megatron_dllm.families.base import Family, seed_for


def validation_run(family: str, seq_length: int, data: DataConfig, tokenizer: TokenizerConfig, *,
                   global_batch_size: int | None = None, eval_iters: int | None = None, seed: int | None = None,
                   family_options: dict | None = None):
    """(RunConfig, Inputs) for the validation split, resolved exactly as pretraining resolves it.

    An empty pretraining command line gives every default pretrain_dllm.py has; the sizes that
    shape megatron's validation index (seq_length, eval_iters x global_batch_size, seed) are then
    the training run's, so the same samples come out in the same order. `family_options`: the
    model's (a checkpoint's record); those that are run flags (BD3-LM's block size, noise) are set.
    An SFT dataset is read as --sft reads it (the bound over response tokens, as SFT validation)."""
    from megatron_dllm.config import parse_args
    from megatron_dllm.config.model import ModelConfig
    from megatron_dllm.data.datasets import parse_data_path
    from megatron_dllm.data.sft import sft_metadata
    from megatron_dllm.training.inputs import prepare_inputs

    config = dataclasses.replace(parse_args([]), data=data, tokenizer=tokenizer)
    paths = [(flag, path) for flag, path in (("--data-path", data.data_path),
                                             ("--train-data-path", data.train_data_path),
                                             ("--valid-data-path", data.valid_data_path)) if path]
    sft = any(sft_metadata(prefix) is not None for flag, path in paths for prefix in parse_data_path(path, flag)[0])
    training = {"global_batch_size": global_batch_size, "seed": seed, "sft": True if sft else None}
    flags = {f.name for f in dataclasses.fields(ModelConfig)}
    options = {k: v for k, v in (family_options or {}).items() if k in flags}
    config = config.replace(model={"family": family, "seq_length": seq_length, **options},
                            # the train split is built too (prepare_inputs always does): keep it one batch;
                            # the evaluation chooses its own micro-batches (1 divides any global batch)
                            training={"train_iters": 1, "micro_batch_size": 1,
                                      **{k: v for k, v in training.items() if v is not None}},
                            logging={"eval_interval": 1, **({"eval_iters": eval_iters} if eval_iters else {})})
    return prepare_inputs(config)


@dataclass
class NelboResult:
    nelbo: float                 # Σ bound / Σ tokens over all draws
    tokens: int                  # tokens scored per draw
    samples: int                 # sequences per draw
    per_draw: list[float] = field(default_factory=list)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nelbo, 700.0))

    @property
    def bpd(self) -> float:
        return self.nelbo / math.log(2)


def draw_seed(seed: int, draw: int) -> int:
    """Noise seed of t draw `draw`: draw 0 is the training-time validation stream seed + 1."""
    return seed + 1 if draw == 0 else seed_for(seed + 1, "t-draw", draw)


@torch.no_grad()
def evaluate_nelbo(model: torch.nn.Module, family: Family, dataset, seed: int, global_batch_size: int,
                   micro_batch_size: int, eval_iters: int, num_t_draws: int = 1) -> NelboResult:
    """The family's bound over `eval_iters` global batches of `dataset`, `num_t_draws` t draws each.

    `model` is the HF-format model (logits [b, s, V]); the family losses take megatron's
    vocab-parallel layout [s, b, V] in a world of one (megatron_dllm.platform.init_distributed)."""
    from megatron_dllm.training.batches import BatchSchedule

    if global_batch_size % micro_batch_size:
        raise InputError(f"--global-batch-size {global_batch_size} is not a multiple of "
                         f"--micro-batch-size {micro_batch_size}")
    total_nll = total_tokens = 0.0
    per_draw, samples = [], 0
    for draw in range(num_t_draws):
        batches = BatchSchedule(dataset, family, draw_seed(seed, draw), micro_batch_size, global_batch_size,
                                dp_rank=0, dp_size=1)
        nll = torch.zeros((), dtype=torch.float64)
        tokens = torch.zeros((), dtype=torch.float64)
        samples = 0
        for i in range(eval_iters):
            for inp in batches.iteration(i * global_batch_size):
                logits = model(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma,
                               attention_mask=inp.attend()).logits
                # the heads compute in fp32 from logits of any dtype: no fp32 copy of them
                per_token = family.nelbo(logits.transpose(0, 1).contiguous(), inp)
                nll += per_token.double().sum().cpu()
                tokens += inp.valid.double().sum().cpu()
                samples += inp.input_ids.shape[0]
        per_draw.append((nll / tokens).item())
        total_nll += nll.item()
        total_tokens += tokens.item()
    return NelboResult(total_nll / total_tokens, int(total_tokens) // num_t_draws, samples, per_draw)
