"""Batch-1 conditional generation throughput per family: left to right (the paper's GSM8K protocol,
one token per model call) vs the family's native sampler, the prompt held fixed.

Throughput is the paper's: generated tokens (up to and including EOS; nothing after it, not the
prompt) per second of generation at batch size 1. A fixed random model per family (cpu-small
dims: hidden 128, 4 layers, 4 heads; the demo vocabulary of 4097 ids incl. [MASK]; context
`--seq-length`) answers a `--prompt-length`-token prompt with `--new-tokens` tokens; EOS is an id
the run never stops at, so every run generates exactly that many (random weights would stop at
random places). Native = MDLM/Duo ancestral and Eso-LM ancestral (KV cache) with `--steps` steps;
AR's native sampler is left to right. The two protocols of a family alternate over `--repeats`
rounds; medians are reported, and the ratio is taken within one run. Both protocols decode alike:
sampled (temperature 1, top-p 1), or with `--greedy` the most likely token (the top-p nucleus of
one id, as `tools/evaluate.py gsm8k` decodes left to right by default). Besides wall time (the
paper's definition) the CPU time of the process is reported: with one torch thread on a shared
machine it is the figure that other processes' load does not inflate. AR's two protocols are the
same computation, so their ratio shows the noise of the measurement.

    python benchmarks/bench_sft_generation.py [--seq-length 256] [--prompt-length 64] [--new-tokens 192] \\
        [--steps 64] [--greedy] [--repeats 3] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import statistics

import harness
import torch
from bench_samplers import FAMILIES, build

from megatron_dllm.sampling.conditional import generate_left_to_right, generate_native

NO_EOS = -1  # never generated: every run produces exactly --new-tokens tokens


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--greedy", action="store_true", help="both protocols greedy (default: both sampled)")
    args = harness.parse_args(ap)
    prompt = torch.randint(1, 4000, (args.prompt_length,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {}
    print(f"## batch 1, context {args.seq_length}, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"native T = {args.steps}, {'greedy' if args.greedy else 'sampled'}, torch threads {args.threads}")
    print("| family | left-to-right tokens/s (wall) | native tokens/s (wall) | native / left-to-right (wall) | "
          "left-to-right tokens/s (CPU) | native tokens/s (CPU) | native / left-to-right (CPU) |\n"
          "|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        inf = build(family, args.seq_length)
        generate_left_to_right(inf, prompt, 4, NO_EOS, greedy=args.greedy)  # warm-up
        walls, cpus = {"l2r": [], "native": []}, {"l2r": [], "native": []}
        for _ in range(args.repeats):
            for key, fn, kw in (("l2r", generate_left_to_right, {"greedy": args.greedy}),
                                ("native", generate_native, {"steps": args.steps, "greedy": args.greedy})):
                w, c, out = harness.timed(fn, inf, prompt, args.new_tokens, NO_EOS, **kw)
                assert len(out) == args.new_tokens
                walls[key].append(w)
                cpus[key].append(c)
        rate = {f"{k}_{m}": args.new_tokens / statistics.median(v[k])
                for m, v in (("wall", walls), ("cpu", cpus)) for k in ("l2r", "native")}
        results[family] = {**rate, "walls": walls, "cpus": cpus}
        print(f"| {family} | {rate['l2r_wall']:.1f} | {rate['native_wall']:.1f} | "
              f"{rate['native_wall'] / rate['l2r_wall']:.2f}x | {rate['l2r_cpu']:.1f} | {rate['native_cpu']:.1f} | "
              f"{rate['native_cpu'] / rate['l2r_cpu']:.2f}x |", flush=True)
    harness.write_json(args, results=results)


if __name__ == "__main__":
    main()
