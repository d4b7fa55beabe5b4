"""Sampler speed per family: samples/s, tokens/s and model calls at several step counts T, plus
side-by-side costs of the caches and of float64 sampling.

A fixed randomly initialised model (cpu-small dims: hidden 128, 4 layers, 4 heads; the demo
tokenizer's vocabulary of 4097 incl. [MASK]) is built once per family; random weights are fine
for speed (the number of model calls of the caches depends on the schedule, not the weights).
One sample per run (batch 1), no prompt, no EOS stopping (every run generates all L tokens).

  grid:        every family at each T (AR ignores T: one call per token), float64, caches on;
               families interleaved within each T, `--repeats` rounds (median), except that a
               run longer than `--repeat-below` seconds is not repeated.
  side by side: at one T, each variant pair (float64 vs float32; cache on vs off) run
               alternately `--repeats` times; medians reported.

    python benchmarks/bench_samplers.py [--seq-length 256] [--steps 16 64 256 1024] \
        [--pair-steps 64] [--repeats 3] [--repeat-below 10] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import statistics
import time

import harness

from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate

FAMILIES = ("ar", "mdlm", "duo", "esolm")
VOCAB = 4097


def build(family: str, length: int, vocab: int = VOCAB) -> InferenceModel:
    model = random_dense_model(family, vocab, length, hidden_size=128, num_layers=4, num_heads=4, cond_dim=128)
    return InferenceModel(model, family, vocab - 1, vocab, length, None, "random")


def run(inf: InferenceModel, **cfg) -> dict:
    calls = [0]
    handle = inf.model.backbone.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    config = SamplingConfig(eos_id=0, stop_at_eos=False, **cfg)
    start = time.perf_counter()
    tokens = generate(inf, config, num_samples=1, seed=0)
    wall = time.perf_counter() - start
    handle.remove()
    return {"wall_s": wall, "samples_per_s": 1 / wall, "tokens_per_s": tokens.shape[1] / wall, "calls": calls[0]}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--pair-steps", type=int, default=64)
    ap.add_argument("--repeat-below", type=float, default=10.0)
    args = harness.parse_args(ap)
    L = args.seq_length
    models = {f: build(f, L) for f in FAMILIES}
    for f in FAMILIES:  # warm-up
        run(models[f], steps=4, seq_length=min(L, 32))

    grid = {}
    print(f"## grid: L = {L}, batch 1, float64, caches on, torch threads {args.threads}")
    print("| family | T | model calls | runs | median wall (s) | samples/s | tokens/s |\n"
          "|---|---|---|---|---|---|---|")
    for T in args.steps:
        walls, calls = {f: [] for f in FAMILIES}, {}
        for round_ in range(args.repeats):
            for f in FAMILIES:
                if round_ and walls[f][0] > args.repeat_below:
                    continue
                r = run(models[f], steps=T)
                walls[f].append(r["wall_s"])
                calls[f] = r["calls"]
        for f in FAMILIES:
            wall = statistics.median(walls[f])
            r = grid[f"{f}/{T}"] = {"wall_s": wall, "runs": walls[f], "calls": calls[f],
                                    "samples_per_s": 1 / wall, "tokens_per_s": L / wall}
            print(f"| {f} | {T if f != 'ar' else f'{T} (n/a)'} | {r['calls']} | {len(walls[f])} | {wall:.2f} | "
                  f"{r['samples_per_s']:.3f} | {r['tokens_per_s']:.0f} |", flush=True)
    print("\n| T | Eso-LM (KV cache) / MDLM (no-change cache), samples/s |\n|---|---|")
    for T in args.steps:
        print(f"| {T} | {grid[f'esolm/{T}']['samples_per_s'] / grid[f'mdlm/{T}']['samples_per_s']:.1f}x |")

    T = args.pair_steps
    pairs = [(f, "float64", {"float64": True}, {"float64": False}) for f in FAMILIES]
    pairs += [(f, "kv_cache", {"kv_cache": True}, {"kv_cache": False}) for f in ("ar", "mdlm", "esolm")]
    side = {}
    print(f"\n## side by side at T = {T}: median wall (s) of {args.repeats} alternating runs")
    print("| family | flag | on (s) | off (s) | on / off | calls on / off |\n|---|---|---|---|---|---|")
    for f, flag, on, off in pairs:
        walls = {"on": [], "off": []}
        calls = {}
        for _ in range(args.repeats):
            for key, extra in (("on", on), ("off", off)):
                r = run(models[f], steps=T, **extra)
                walls[key].append(r["wall_s"])
                calls[key] = r["calls"]
        a, b = statistics.median(walls["on"]), statistics.median(walls["off"])
        side[f"{f}/{flag}"] = {"on_s": a, "off_s": b, "calls": calls}
        print(f"| {f} | {flag} | {a:.2f} | {b:.2f} | {a / b:.2f} | {calls['on']} / {calls['off']} |", flush=True)
    harness.write_json(args, grid=grid, side_by_side=side)


if __name__ == "__main__":
    main()
