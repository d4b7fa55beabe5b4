"""Batched vs batch-1 conditional generation per family: one batch of prompts of different lengths
against a loop of batch-1 calls over the same prompts and seeds.

A fixed random model per family (cpu-small dims: hidden 128, 4 layers, 4 heads; the demo
vocabulary of 4097 ids; context `--seq-length`) answers `--batch` prompts of lengths spread over
[`--min-prompt`, `--max-prompt`] with `--new-tokens` tokens each; EOS is an id the run never
stops at, so every row generates exactly that many. Protocols: left to right (the GSM8K / lm-eval
protocol, one token per model call) and native (MDLM/Duo ancestral, Eso-LM ancestral with its KV
cache, `--steps` steps; AR's native sampler is left to right, so only its left-to-right row is
run). BD3-LM (`--bd3lm-block-size B`, mask noise; 0 leaves it out) runs both protocols inside
its blocks over its exact block KV cache, native with `--steps` per block. For each family and protocol the batch-1
loop and the batched call alternate over `--repeats` rounds; medians are reported and the
speed-up is the ratio within one run. Wall and process CPU time are both given (CPU time is the
steadier figure on a shared machine). The
`same` column says whether the batched rows equal the batch-1 outputs token for token (float32
model here; the tests check it in float64).

    python benchmarks/bench_batched_generation.py [--batch 8] [--seq-length 128] [--new-tokens 32] \\
        [--steps 16] [--repeats 3] [--threads 1] [--json out.json] [--bd3lm-block-size 8 [--families]]

`--caches static`: instead, the AR and Eso-LM KV caches side by side, static (preallocated,
written in place) vs growing (concatenated per step), each at batch 1 and batched, same rounds.
`--caches approx`: instead, MDLM and Duo native block-wise decoding (`--block-length`, `--steps`
per block) without a cache (exact) vs Fast-dLLM's approximate prefix and dual caches, same rounds.
"""
from __future__ import annotations

import statistics

import harness
import torch
from bench_samplers import FAMILIES, VOCAB, build

from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel
from megatron_dllm.sampling.base import Sampler
from megatron_dllm.sampling.conditional import (
    generate_left_to_right,
    generate_left_to_right_batch,
    generate_native,
    generate_native_batch,
)

NO_EOS = -1  # never generated: every row produces exactly --new-tokens tokens


def build_bd3lm(length: int, block_size: int) -> InferenceModel:
    """bench_samplers.build's model for BD3-LM (mask noise, blocks of `block_size`)."""
    options = {"block_size": block_size, "noise": "mask"}
    model = random_dense_model("bd3lm", VOCAB, length, hidden_size=128, num_layers=4, num_heads=4, cond_dim=128,
                               family_options=options)
    return InferenceModel(model, "bd3lm", VOCAB - 1, VOCAB, length, None, "random", family_options=options)


def compare(inf, one, batched, kw, prompts, seeds, args) -> tuple[dict, dict, bool]:
    """Alternating rounds of the batch-1 loop and the batched call: (wall s, CPU s per round, same outputs)."""
    walls, cpus, same = {"one": [], "batch": []}, {"one": [], "batch": []}, True
    for _ in range(args.repeats):
        outs = {}
        for key in ("one", "batch"):
            if key == "one":
                w, c, outs[key] = harness.timed(lambda: [one(inf, p, args.new_tokens, NO_EOS, seed=s, **kw)
                                                         for p, s in zip(prompts, seeds)])
            else:
                w, c, outs[key] = harness.timed(batched, inf, prompts, args.new_tokens, NO_EOS, seeds=seeds, **kw)
            assert all(len(r) == args.new_tokens for r in outs[key])
            walls[key].append(w)
            cpus[key].append(c)
        same &= outs["one"] == outs["batch"]
    return walls, cpus, same


def run_calls(inf, fn, calls, kw, prompts, seeds, args) -> list:
    """The batch-1 loop (calls "one") or the batched call over all prompts."""
    if calls == "one":
        return [fn(inf, p, args.new_tokens, NO_EOS, seed=s, **kw) for p, s in zip(prompts, seeds)]
    return fn(inf, prompts, args.new_tokens, NO_EOS, seeds=seeds, **kw)


def compare_static_caches(prompts, seeds, tokens, args) -> dict:
    """Static vs growing KV cache for AR and Eso-LM, batch-1 loop and batched, alternating rounds."""
    print("| family | protocol | calls | growing tok/s (CPU) | static tok/s (CPU) | static / growing (CPU) | "
          "static / growing (wall) | same |\n|---|---|---|---|---|---|---|---|")
    results = {}
    for family in ("ar", "esolm"):
        inf = build(family, args.seq_length)
        generate_left_to_right_batch(inf, prompts[:2], 2, NO_EOS)  # warm-up
        protocols = [("left-to-right", generate_left_to_right, generate_left_to_right_batch, {"greedy": False})]
        if family == "esolm":
            protocols.append(("native", generate_native, generate_native_batch, {"steps": args.steps}))
        for name, one, batched, kw in protocols:
            for calls in ("one", "batch"):
                walls, cpus, outs = {True: [], False: []}, {True: [], False: []}, {}
                for _ in range(args.repeats):
                    for static in (False, True):
                        Sampler.static_kv_cache = static
                        w, c, outs[static] = harness.timed(
                            run_calls, inf, one if calls == "one" else batched, calls, kw, prompts, seeds, args)
                        walls[static].append(w)
                        cpus[static].append(c)
                Sampler.static_kv_cache = True
                cpu = {k: tokens / statistics.median(v) for k, v in cpus.items()}
                wall = {k: tokens / statistics.median(v) for k, v in walls.items()}
                same = outs[True] == outs[False]
                results[f"{family}/{name}/{calls}"] = {"walls": walls, "cpus": cpus, "same": same}
                print(f"| {family} | {name} | {'batch-1 loop' if calls == 'one' else 'batched'} | {cpu[False]:.1f} | "
                      f"{cpu[True]:.1f} | {cpu[True] / cpu[False]:.2f}x | {wall[True] / wall[False]:.2f}x | "
                      f"{'yes' if same else 'NO'} |", flush=True)
    return results


def compare_approx_caches(prompts, seeds, tokens, args) -> dict:
    """MDLM/Duo block-wise native decoding: none vs prefix vs dual, batch-1 loop and batched."""
    modes = ("none", "prefix", "dual")
    print("| family | calls | none tok/s (CPU) | prefix tok/s (CPU) | dual tok/s (CPU) | prefix / none (CPU) | "
          "dual / none (CPU) | prefix / none (wall) | dual / none (wall) |\n|---|---|---|---|---|---|---|---|---|")
    results = {}
    for family in ("mdlm", "duo"):
        inf = build(family, args.seq_length)
        generate_native_batch(inf, prompts[:2], 2, NO_EOS, steps=2)  # warm-up
        for calls in ("one", "batch"):
            walls, cpus = {m: [] for m in modes}, {m: [] for m in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    kw = {"steps": args.steps, "block_length": args.block_length, "approx_kv_cache": mode}
                    w, c, _ = harness.timed(run_calls, inf, generate_native if calls == "one" else
                                            generate_native_batch, calls, kw, prompts, seeds, args)
                    walls[mode].append(w)
                    cpus[mode].append(c)
            cpu = {m: tokens / statistics.median(v) for m, v in cpus.items()}
            wall = {m: tokens / statistics.median(v) for m, v in walls.items()}
            results[f"{family}/{calls}"] = {"walls": walls, "cpus": cpus}
            print(f"| {family} | {'batch-1 loop' if calls == 'one' else 'batched'} | {cpu['none']:.1f} | "
                  f"{cpu['prefix']:.1f} | {cpu['dual']:.1f} | {cpu['prefix'] / cpu['none']:.2f}x | "
                  f"{cpu['dual'] / cpu['none']:.2f}x | {wall['prefix'] / wall['none']:.2f}x | "
                  f"{wall['dual'] / wall['none']:.2f}x |", flush=True)
    return results


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--caches", choices=["static", "approx"], default=None,
                    help="static: the static vs growing KV caches of AR and Eso-LM instead; approx: MDLM/Duo "
                         "block-wise decoding without a cache vs the prefix and dual caches")
    ap.add_argument("--block-length", type=int, default=32, help="--caches approx: the block length")
    ap.add_argument("--bd3lm-block-size", type=int, default=0, help="also BD3-LM with blocks of B (0: not run)")
    ap.add_argument("--families", nargs="*", choices=FAMILIES, default=None,
                    help="only these of ar mdlm duo esolm (default: all; the flag alone: none, e.g. BD3-LM alone)")
    args = harness.parse_args(ap)
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.min_prompt, args.max_prompt, args.batch).round().long().tolist()
    prompts = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in lengths]
    seeds = list(range(args.batch))
    tokens = args.batch * args.new_tokens
    if args.caches:
        title = ("static vs growing KV cache" if args.caches == "static" else
                 f"approximate KV caches, block length {args.block_length}, T = {args.steps} per block")
        print(f"## {title}: {args.batch} prompts ({args.min_prompt}-{args.max_prompt} tokens), context "
              f"{args.seq_length}, {args.new_tokens} new tokens per row, native T = {args.steps}, "
              f"torch threads {args.threads}")
        compare_caches = compare_static_caches if args.caches == "static" else compare_approx_caches
        results = compare_caches(prompts, seeds, tokens, args)
        harness.write_json(args, prompt_lengths=lengths, results=results)
        return
    print(f"## batch {args.batch} (prompts {args.min_prompt}-{args.max_prompt} tokens) vs {args.batch} batch-1 calls, "
          f"context {args.seq_length}, {args.new_tokens} new tokens per row, native T = {args.steps}, "
          f"torch threads {args.threads}")
    print("| family | protocol | batch-1 tok/s (wall) | batched tok/s (wall) | speed-up (wall) | "
          "batch-1 tok/s (CPU) | batched tok/s (CPU) | speed-up (CPU) | same |\n|---|---|---|---|---|---|---|---|---|")
    results = {}
    families = [f for f in FAMILIES if args.families is None or f in args.families]
    for family in families + ["bd3lm"] * bool(args.bd3lm_block_size):
        inf = (build_bd3lm(args.seq_length, args.bd3lm_block_size) if family == "bd3lm"
               else build(family, args.seq_length))
        generate_left_to_right_batch(inf, prompts[:2], 2, NO_EOS)  # warm-up
        protocols = [("left-to-right", generate_left_to_right, generate_left_to_right_batch, {"greedy": False})]
        if family != "ar":
            protocols.append(("native", generate_native, generate_native_batch, {"steps": args.steps}))
        for name, one, batched, kw in protocols:
            walls, cpus, same = compare(inf, one, batched, kw, prompts, seeds, args)
            rate = {f"{k}_{m}": tokens / statistics.median(v[k])
                    for m, v in (("wall", walls), ("cpu", cpus)) for k in ("one", "batch")}
            results[f"{family}/{name}"] = {**rate, "walls": walls, "cpus": cpus, "same": same}
            print(f"| {family} | {name} | {rate['one_wall']:.1f} | {rate['batch_wall']:.1f} | "
                  f"{rate['batch_wall'] / rate['one_wall']:.2f}x | {rate['one_cpu']:.1f} | {rate['batch_cpu']:.1f} | "
                  f"{rate['batch_cpu'] / rate['one_cpu']:.2f}x | {'yes' if same else 'NO'} |", flush=True)
    harness.write_json(args, prompt_lengths=lengths, results=results)


if __name__ == "__main__":
    main()
