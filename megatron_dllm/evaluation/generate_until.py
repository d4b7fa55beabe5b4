"""lm-eval's `generate_until` for every family through the batched left-to-right generator
(or, with the model's `generation_predictor`, the batched native one).

Each request's context (left-truncated so that `max_gen_toks` new tokens fit in the model's
context) is the prompt of `sampling.conditional.generate_left_to_right_batch`, the generator
shared with the SFT/GSM8K evaluation: one token per model call in sequence order (AR: next-token;
MDLM, Duo, Eso-LM: their left-to-right denoising), the prompt never altered, stopping at EOD.
Greedy unless the task asks `do_sample` (then its temperature), request i seeded by seed + i.
Requests with the same generation settings run in batches of the model's `batch_size`
(`evaluation.generation_batches`; 'auto' as there); every text is the batch-1 text. The text is
cut at the first of the task's `until` strings.
"""
from __future__ import annotations

from tqdm import tqdm

from megatron_dllm.evaluation.generation_batches import in_batches


def _settings(gen_kwargs: dict, default_max: int) -> tuple[list[str], int, bool, float]:
    """(until, max_gen_toks, greedy, temperature) from lm-eval's generation arguments."""
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    max_gen = int(gen_kwargs.get("max_gen_toks", default_max))
    temperature = float(gen_kwargs.get("temperature", 1.0))
    sample = bool(gen_kwargs.get("do_sample", False)) and temperature > 0
    return until, max_gen, not sample, temperature if sample else 1.0


def generate_until(lm, requests, disable_tqdm: bool = False) -> list[str]:
    """One continuation text per lm-eval request (args = (context, gen_kwargs))."""
    args = [r.args for r in requests]
    settings, prompts, groups = [], [], {}
    for index, (context, gen_kwargs) in enumerate(args):
        until, max_gen, greedy, temperature = _settings(gen_kwargs, lm.max_gen_toks)
        max_gen = max(1, min(max_gen, lm.max_length - 1))
        settings.append((until, max_gen, greedy, temperature))
        prompts.append((lm.tok_encode(context) or [lm.prefix_token_id])[-(lm.max_length - max_gen):])
        groups.setdefault((max_gen, greedy, temperature), []).append(index)

    new: list = [None] * len(args)
    with tqdm(total=len(args), disable=disable_tqdm, desc="generate_until") as bar:
        for (max_gen, greedy, temperature), members in groups.items():
            for i, ids in zip(members, _generate(lm, prompts, members, max_gen, greedy, temperature, bar)):
                new[i] = ids

    out = []
    for (context, gen_kwargs), (until, *_), ids in zip(args, settings, new):
        if ids and ids[-1] == lm.eot_token_id:
            ids = ids[:-1]
        text = lm.tok_decode(ids)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        lm.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        out.append(text)
    return out


def _generate(lm, prompts, members: list[int], max_gen: int, greedy: bool, temperature: float, bar) -> list:
    """Generated ids of the requests `members` (equal settings), in batches, in that order."""
    from megatron_dllm.sampling.conditional import generate_left_to_right_batch, generate_native_batch

    options = dict(lm.generation)
    native = options["predictor"] != "left-to-right"
    generator = generate_native_batch if native else generate_left_to_right_batch
    if not native:
        options = {}

    def run(chunk: list[int]) -> list[list[int]]:
        out = generator(
            lm.inference_model, [prompts[members[j]] for j in chunk], max_new_tokens=max_gen, eos_id=lm.eot_token_id,
            greedy=greedy, temperature=temperature, seeds=[lm.seed + members[j] for j in chunk], **options)
        bar.update(len(chunk))
        return out

    return in_batches([len(prompts[i]) for i in members], lm.generation_batch_size, lm.inference_model.device, run)
