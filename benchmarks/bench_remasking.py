"""Remasking predictors against the family's ancestral sampler: model calls and tokens/s.

Question: how many forward passes and how much wall time do low-confidence (LLaDA), threshold
(Fast-dLLM) and entropy-bound decoding, with and without blocks, take against the ancestral
sampler for the same sequence length? Threshold and entropy-bound commit as many tokens per call
as the model is confident about, so their cost depends on the weights: pass a trained checkpoint
(`--load`, e.g. the demo MDLM) for meaningful figures; without one, a random cpu-small-sized model.

Timed: `sampling.generate` (the code path of tools/sample.py), batch 1, one sample of L tokens
after an optional prompt, no EOS stopping (every run generates all L - P tokens); model calls are
counted with a forward pre-hook on the backbone. Variants run interleaved in `--repeats` rounds
after one warm-up round; medians reported, with the wall-time ratio to the first variant
(ancestral at the largest T) per round.

    python benchmarks/bench_remasking.py [--load runs/demo-mdlm/checkpoints] [--family mdlm] \
        [--seq-length 128] [--prompt "ROMEO:"] [--repeats 3] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import statistics
import time

import harness
from bench_samplers import build as random_model

from megatron_dllm import platform
from megatron_dllm.sampling import SamplingConfig, generate, load_inference_model

VARIANTS = [  # (label, SamplingConfig fields)
    ("ancestral T=L", {"predictor": "ancestral", "steps": None}),
    ("ancestral T=L/4", {"predictor": "ancestral", "steps": "L/4"}),
    ("low-confidence T=L", {"predictor": "low-confidence", "steps": None}),
    ("low-confidence T=L/4", {"predictor": "low-confidence", "steps": "L/4"}),
    ("low-confidence T=L/4, blocks of 32", {"predictor": "low-confidence", "steps": "L/4", "block_length": 32}),
    ("threshold 0.9", {"predictor": "threshold", "confidence_threshold": 0.9}),
    ("threshold 0.9, blocks of 32", {"predictor": "threshold", "confidence_threshold": 0.9, "block_length": 32}),
    ("threshold 0.7, blocks of 32", {"predictor": "threshold", "confidence_threshold": 0.7, "block_length": 32}),
    ("entropy-bound 0.1", {"predictor": "entropy-bound", "entropy_bound": 0.1}),
    ("entropy-bound 1.0, blocks of 32", {"predictor": "entropy-bound", "entropy_bound": 1.0, "block_length": 32}),
]


def run(inf, cfg: SamplingConfig, prompt, seed: int) -> dict:
    calls = [0]
    handle = inf.model.backbone.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    start = time.perf_counter()
    generate(inf, cfg, num_samples=1, seed=seed, prompt_ids=prompt)
    wall = time.perf_counter() - start
    handle.remove()
    return {"wall_s": wall, "calls": calls[0]}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--load", default=None, help="checkpoint or HF directory (default: a random model)")
    ap.add_argument("--family", default="mdlm", choices=("mdlm", "duo"), help="the random model's family")
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--prompt", default=None, help="text in front of every sample (needs --load's tokenizer)")
    args = harness.parse_args(ap)
    L = args.seq_length
    inf = load_inference_model(args.load, platform.device()) if args.load else random_model(args.family, L)
    if inf.family not in ("mdlm", "duo"):  # the remasking predictors are theirs
        ap.error(f"--load {args.load}: a {inf.family} model; the remasking predictors are MDLM's and Duo's")
    prompt = inf.tokenizer.tokenize(args.prompt) if args.prompt else None
    generated = L - len(prompt or [])
    configs = []
    for label, fields in VARIANTS:
        fields = dict(fields)
        steps = {None: L, "L/4": L // 4}.get(fields.pop("steps", None), L)
        configs.append((label, SamplingConfig(steps=steps, seq_length=L, eos_id=0, stop_at_eos=False, **fields)))
    for _, cfg in configs:  # warm-up
        run(inf, cfg, prompt, seed=0)
    walls = {label: [] for label, _ in configs}
    calls = {label: [] for label, _ in configs}
    for round_ in range(args.repeats):
        for label, cfg in configs:
            r = run(inf, cfg, prompt, seed=1 + round_)
            walls[label].append(r["wall_s"])
            calls[label].append(r["calls"])
    base = configs[0][0]
    print(f"## {inf.family} ({args.load or 'random weights'}), L = {L}, {generated} generated tokens, batch 1, "
          f"float64 sampling, torch threads {args.threads}, {args.repeats} rounds")
    print("| sampler | model calls (median) | tokens per call | median wall (s) | tokens/s | wall / ancestral T=L |\n"
          "|---|---|---|---|---|---|")
    results = {}
    for label, _ in configs:
        wall, n = statistics.median(walls[label]), statistics.median(calls[label])
        ratio = statistics.median(w / b for w, b in zip(walls[label], walls[base]))
        results[label] = {"walls": walls[label], "calls": calls[label], "ratio": ratio}
        print(f"| {label} | {n:g} | {generated / n:.2f} | {wall:.2f} | {generated / wall:.0f} | {ratio:.2f} |")
    harness.write_json(args, results=results)


if __name__ == "__main__":
    main()
