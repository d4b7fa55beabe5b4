"""lm-eval's `generate_until` for every family through the left-to-right generator.

Each request's context (left-truncated so that `max_gen_toks` new tokens fit in the model's
context) is the prompt of `sampling.conditional.generate_left_to_right`, the generator shared
with the SFT/GSM8K evaluation: one token per model call in sequence order (AR: next-token; MDLM,
Duo, Eso-LM: their left-to-right denoising), the prompt never altered, stopping at EOD. Greedy
unless the task asks `do_sample` (then its temperature). The text is cut at the first of the
task's `until` strings.
"""
from __future__ import annotations

from tqdm import tqdm


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
    from megatron_dllm.sampling.conditional import generate_left_to_right

    out = []
    for index, (context, gen_kwargs) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm,
                                                       desc="generate_until")):
        until, max_gen, greedy, temperature = _settings(gen_kwargs, lm.max_gen_toks)
        max_gen = max(1, min(max_gen, lm.max_length - 1))
        prompt = (lm.tok_encode(context) or [lm.prefix_token_id])[-(lm.max_length - max_gen):]
        new = generate_left_to_right(lm.inf, prompt, max_new_tokens=max_gen, eos_id=lm.eot_token_id,
                                     greedy=greedy, temperature=temperature, seed=lm.seed + index)
        if new and new[-1] == lm.eot_token_id:
            new = new[:-1]
        text = lm.tok_decode(new)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        lm.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        out.append(text)
    return out
