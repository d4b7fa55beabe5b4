"""Conditional generation: a response to one prompt, for every family, the prompt never altered.

    from megatron_dllm.sampling.loading import load_inference_model
    from megatron_dllm.sampling.conditional import generate_left_to_right, generate_native

    inf = load_inference_model("runs/sft/checkpoints")
    ids = generate_left_to_right(inf, inf.tokenizer.tokenize("Question: ...\\n"), max_new_tokens=200)
    text = inf.tokenizer.detokenize(ids)

Two protocols, both returning the generated ids only (no prompt), cut after the first EOS (the
EOS included; nothing after it), so `len(ids)` is what batch-1 throughput counts:
  - `generate_left_to_right`: one token per model call, in sequence order (the paper's GSM8K
    protocol for every family). AR: next-token sampling with its KV cache. MDLM: the canvas is
    the prompt then [MASK] up to the context, the leftmost mask is filled each step. Duo: the
    canvas is the prompt then uniform noise, position by position denoised with
    alpha = the clean fraction. Eso-LM: causal decoding in sequence order with its KV cache (the
    prompt first, in order, exactly as SFT trains it). Generation stops at EOS or after
    `max_new_tokens`.
  - `generate_native`: the family's own sampler (MDLM/Duo ancestral over `steps` steps, Eso-LM
    ancestral with its KV cache, AR = left to right; or another `predictor`, such as MDLM/Duo's
    low-confidence remasking) on a canvas of `max_new_tokens` positions after the prompt, which
    is held fixed; the result is cut at its first EOS.
The canvas of the diffusion families is prompt + `max_new_tokens` (default: up to the model's
training context, as SFT rows are EOS-padded to it). `greedy=True` (default) takes the most
likely token (the top-p nucleus of one id); otherwise `temperature`/`top_p` sampling seeded by
`seed`.

Batches: `generate_left_to_right_batch` / `generate_native_batch` take a list of prompts of any
lengths and one seed per prompt (or one for all) and return, per prompt, exactly the ids of the
batch-1 call with that prompt and seed (`PromptBatch`: per-row canvases and generators, padding
never attended). Rows leave the batch when they end, so a batch costs what its longest row costs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import SamplingConfig
from .deps import InputError, seed_for
from .esolm import EsoLMSampler
from .generate import check_prompt
from .prompt_batch import PromptBatch
from .registry import get_sampler

GREEDY_TOP_P = 1e-12  # the nucleus keeps at least one id: a vanishing top-p keeps exactly the argmax


def _canvas_length(inf, prompt_len: int, max_new_tokens: int | None) -> int:
    if prompt_len < 1:
        raise InputError("conditional generation needs a prompt of at least one token")
    room = inf.seq_length - prompt_len
    if room < 1:
        raise InputError(f"the prompt is {prompt_len} tokens; the model's context is {inf.seq_length}, "
                         f"which leaves no room to generate")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise InputError(f"max_new_tokens {max_new_tokens}: must be >= 1")
    return prompt_len + min(room, max_new_tokens or room)


def _cut_at_eos(row: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in row:
        return row[:row.index(eos_id) + 1]
    return row


class _PromptInOrderEsoLM(EsoLMSampler):
    """Eso-LM's sampler with the prompt attended in sequence order (as SFT trains it)."""

    def plan(self, b, p, generator, device, length=None):
        order, counts = super().plan(b, p, generator, device, length)
        order[:, :p] = torch.arange(p, device=device)
        return order, counts


def _sampler(inf, cfg: SamplingConfig):
    sampler = get_sampler(inf, cfg)
    if isinstance(sampler, EsoLMSampler):
        sampler = _PromptInOrderEsoLM(sampler.family, inf, cfg)
    if sampler.eos_id is None and cfg.predictor == "left-to-right":
        raise InputError("no EOS id: give eos_id or load the model with its tokenizer")
    return sampler


def _generator(inf, seed: int) -> torch.Generator:
    return torch.Generator(device=inf.device).manual_seed(seed_for("conditional", seed))


def _run(inf, prompt_ids: Sequence[int], cfg: SamplingConfig, seed: int) -> list[int]:
    prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=inf.device)[None, :]
    check_prompt(inf, prompt)
    sampler = _sampler(inf, cfg)
    generator = _generator(inf, seed)
    with torch.inference_mode():
        out = sampler.sample(prompt, generator)[0].tolist()
    return _cut_at_eos(out[prompt.shape[1]:], sampler.eos_id)


def _config(inf, prompt_ids, max_new_tokens, eos_id, greedy, temperature, top_p, **kw) -> SamplingConfig:
    return SamplingConfig(seq_length=_canvas_length(inf, len(prompt_ids), max_new_tokens), eos_id=eos_id,
                          temperature=1.0 if greedy else temperature, top_p=GREEDY_TOP_P if greedy else top_p,
                          stop_at_eos=True, **kw)


def generate_left_to_right(inf, prompt_ids: Sequence[int], max_new_tokens: int | None = None,
                           eos_id: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
                           top_p: float = 1.0, seed: int = 0) -> list[int]:
    """The response to `prompt_ids`, generated left to right one token per model call.

    inf: an `InferenceModel` (`sampling.loading.load_inference_model`: a megatron checkpoint or an
        HF export; it carries the model, its family, [MASK] id and context length).
    prompt_ids: the prompt's token ids (at least one; never altered).
    max_new_tokens: at most this many new tokens (default and cap: the context left after the prompt).
    eos_id: stop token (default: the tokenizer's EOD).
    Returns the generated ids, ending with EOS when one was generated (nothing after it).
    """
    cfg = _config(inf, prompt_ids, max_new_tokens, eos_id, greedy, temperature, top_p, predictor="left-to-right")
    return _run(inf, prompt_ids, cfg, seed)


def generate_native(inf, prompt_ids: Sequence[int], max_new_tokens: int | None = None, eos_id: int | None = None,
                    *, steps: int = 64, greedy: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                    seed: int = 0, predictor: str = "ancestral", **options) -> list[int]:
    """The response to `prompt_ids` from the family's own sampler (`steps` denoising steps; AR is
    left to right), the prompt held fixed; cut after the first EOS. Arguments as
    `generate_left_to_right`; `predictor` and `options` (`SamplingConfig` fields such as
    `block_length`) pick another of the family's predictors (e.g. "low-confidence")."""
    cfg = _config(inf, prompt_ids, max_new_tokens, eos_id, greedy, temperature, top_p, predictor=predictor,
                  steps=steps, **options)
    return _run(inf, prompt_ids, cfg, seed)


def _run_batch(inf, prompts: Sequence[Sequence[int]], max_new_tokens: int | None, seeds, pad_id: int,
               **config) -> list[list[int]]:
    prompts = [list(p) for p in prompts]
    if not prompts:
        return []
    seeds = [seeds] * len(prompts) if isinstance(seeds, int) else list(seeds)
    if len(seeds) != len(prompts):
        raise InputError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
    lengths = [_canvas_length(inf, len(p), max_new_tokens) for p in prompts]
    if len(prompts) == 1:  # batch 1's sampler: the same ids, with the fixed shapes CUDA graphs capture
        return [_run(inf, prompts[0], SamplingConfig(seq_length=lengths[0], stop_at_eos=True, **config), seeds[0])]
    for p in prompts:
        check_prompt(inf, torch.as_tensor(p, dtype=torch.long))
    sampler = _sampler(inf, SamplingConfig(seq_length=max(lengths), stop_at_eos=True, **config))
    batch = PromptBatch(prompts, lengths, [_generator(inf, seed) for seed in seeds], inf.device, pad_id)
    with torch.inference_mode():
        rows = sampler.sample_batch(batch)
    return [_cut_at_eos(row, sampler.eos_id) for row in rows]


def _sampling(greedy: bool, temperature: float, top_p: float) -> dict:
    return {"temperature": 1.0 if greedy else temperature, "top_p": GREEDY_TOP_P if greedy else top_p}


def generate_left_to_right_batch(inf, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                                 eos_id: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
                                 top_p: float = 1.0, seeds: int | Sequence[int] = 0, pad_id: int = 0,
                                 cuda_graphs: bool = False) -> list[list[int]]:
    """`generate_left_to_right` for many prompts (of any lengths) in one batch: element i is
    exactly `generate_left_to_right(inf, prompts[i], ..., seed=seeds[i])`. `seeds`: one per
    prompt, or one int for all; `pad_id`: the id padding holds (any: it changes nothing);
    `cuda_graphs`: `SamplingConfig.cuda_graphs` (a batch of one prompt; larger batches mask their
    padding, and such forwards run eagerly)."""
    return _run_batch(inf, prompts, max_new_tokens, seeds, pad_id, eos_id=eos_id, predictor="left-to-right",
                      cuda_graphs=cuda_graphs, **_sampling(greedy, temperature, top_p))


def generate_native_batch(inf, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                          eos_id: int | None = None, *, steps: int = 64, greedy: bool = False,
                          temperature: float = 1.0, top_p: float = 1.0, seeds: int | Sequence[int] = 0,
                          pad_id: int = 0, predictor: str = "ancestral", **options) -> list[list[int]]:
    """`generate_native` for many prompts in one batch; element i is exactly
    `generate_native(inf, prompts[i], ..., seed=seeds[i])`. Arguments as
    `generate_left_to_right_batch` and `generate_native`."""
    return _run_batch(inf, prompts, max_new_tokens, seeds, pad_id, eos_id=eos_id, predictor=predictor,
                      steps=steps, **_sampling(greedy, temperature, top_p), **options)
