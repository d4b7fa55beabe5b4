"""lm-eval's `generate_until` for every family through the left-to-right sampler.

Each request's context (left-truncated so that `max_gen_toks` new tokens fit in the model's
context) is the prompt of `sampling.generate` with `--predictor left-to-right`: one position per
step, for AR its next-token sampler, for MDLM/Duo/Eso-LM the denoiser filling the next masked
position. Greedy unless the task asks `do_sample` (then its temperature, top-p 1). Generation
stops at EOD (`stop_at_eos`); the text is then cut at the first of the task's `until` strings.
"""
from __future__ import annotations

from tqdm import tqdm

# nucleus mass that keeps only the most likely id: greedy decoding through the categorical sampler
GREEDY_TOP_P = 1e-12


def _settings(gen_kwargs: dict, default_max: int) -> tuple[list[str], int, float, float]:
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    max_gen = int(kwargs.pop("max_gen_toks", default_max))
    if kwargs.pop("do_sample", False) and float(kwargs.get("temperature", 1.0)) > 0:
        return until, max_gen, float(kwargs.get("temperature", 1.0)), 1.0
    return until, max_gen, 1.0, GREEDY_TOP_P


def generate_until(lm, requests, disable_tqdm: bool = False) -> list[str]:
    """One continuation text per lm-eval request (args = (context, gen_kwargs))."""
    from megatron_dllm.sampling import SamplingConfig, generate

    out = []
    for index, (context, gen_kwargs) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm,
                                                       desc="generate_until")):
        until, max_gen, temperature, top_p = _settings(gen_kwargs, lm.max_gen_toks)
        max_gen = min(max_gen, lm.max_length - 1)
        prompt = (lm.tok_encode(context) or [lm.prefix_token_id])[-(lm.max_length - max_gen):]
        cfg = SamplingConfig(predictor="left-to-right", seq_length=len(prompt) + max_gen, top_p=top_p,
                             temperature=temperature, stop_at_eos=True, eos_id=lm.eot_token_id)
        tokens = generate(lm.inf, cfg, num_samples=1, seed=lm.seed + index, prompt_ids=prompt)[0, len(prompt):]
        new = tokens.tolist()
        if lm.eot_token_id in new:
            new = new[:new.index(lm.eot_token_id)]
        text = lm.tok_decode(new)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        lm.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        out.append(text)
    return out
