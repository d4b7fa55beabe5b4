"""generate(): batches of samples from any family's sampler; decode(): ids -> text (whole samples, EOD dropped).

Randomness: batch i (samples [i*B, (i+1)*B)) draws from one generator seeded by (seed, first
sample index), so a run is reproducible for a given (seed, batch size) whatever the device count.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import SamplingConfig
from .deps import InputError, seed_for
from .registry import get_sampler


def _prompts(prompt_ids, num_samples: int, length: int, device) -> torch.Tensor:
    """[N, P] prompt ids (P may be 0) from None, a list/1-D tensor (shared) or an [N, P] tensor."""
    if prompt_ids is None:
        return torch.zeros(num_samples, 0, dtype=torch.long, device=device)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if prompt.dim() == 1:
        prompt = prompt.expand(num_samples, -1)
    if prompt.dim() != 2 or prompt.shape[0] != num_samples:
        raise InputError(f"prompt_ids: expected a list of ids or an [{num_samples}, P] tensor, "
                         f"got shape {tuple(prompt.shape)}")
    if prompt.shape[1] >= length:
        raise InputError(f"--prompt is {prompt.shape[1]} tokens; it must be shorter than the sequence "
                         f"length {length} (--seq-length)")
    return prompt


def check_prompt(inf, prompt: torch.Tensor) -> None:
    """Prompt ids are the model's real ids: a [MASK] among them would be decoded like the canvas's."""
    if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= inf.vocab_size
                           or bool((prompt == inf.mask_id).any())):
        raise InputError(f"prompt_ids: ids must be in [0, {inf.vocab_size}) and not [MASK] ({inf.mask_id})")


def generate(inf, cfg: SamplingConfig, num_samples: int = 1, batch_size: int | None = None, seed: int = 0,
             prompt_ids: Sequence[int] | torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """[num_samples, L] token ids (CPU LongTensor), the prompt (if any) in front of every row.
    `generator`: every batch draws from it, in turn, instead of from its seeded one."""
    for flag, value in (("--num-samples", num_samples), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value}: must be >= 1")
    sampler = get_sampler(inf, cfg)
    prompts = _prompts(prompt_ids, num_samples, sampler.length, inf.device)
    check_prompt(inf, prompts)
    batch_size = batch_size or num_samples
    out = []
    with torch.inference_mode():
        for first in range(0, num_samples, batch_size):
            draws = generator or torch.Generator(device=inf.device).manual_seed(seed_for("sample", seed, first))
            out.append(sampler.sample(prompts[first:first + batch_size], draws).cpu())
    return torch.cat(out)


def decode(inf, tokens: torch.Tensor, cut_at_eod: bool = False) -> list[str]:
    """One text per row: the whole sample with its EOD tokens dropped, as the paper's code decodes
    it for Gen PPL (its tokenizer drops EOS), so every document of the sample is scored.

    `cut_at_eod=True` is the earlier behaviour: leading EOD tokens (AR's start token) dropped, the
    text cut at the next EOD, so only the sample's first document remains."""
    tok = inf.tokenizer
    if tok is None:
        raise InputError("decode needs a tokenizer: load the model with --tokenizer-type/--tokenizer-model")
    texts = []
    for row in torch.as_tensor(tokens).tolist():
        if cut_at_eod:
            start = 0
            while start < len(row) and row[start] == tok.eod:
                start += 1
            row = row[start:]
            if tok.eod in row:
                row = row[:row.index(tok.eod)]
        texts.append(tok.detokenize([i for i in row if i not in (inf.mask_id, tok.eod)]))
    return texts
