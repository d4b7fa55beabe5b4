"""Another checkout's samplers beside this one's, in one process: conditional generation per family
and protocol, the two versions alternating round by round.

`CHECKOUT` is a directory holding another commit of this repository (`git worktree add DIR COMMIT`);
its `megatron_dllm/sampling/` is loaded as a package of its own beside this checkout's, over the
same models (this checkout's model code, family code and random weights), so the figures differ
only by the sampler files. Timing both in one process keeps the comparison clear of what differs
between processes on a shared machine, which on this one reached 10%.

The workload is `bench_batched_generation.py`'s: a fixed random model per family at the CPU
demo's shape (hidden 128, 4 layers, vocabulary `--vocab`, default 4,097), `--batch` prompts of 8 to 48 tokens with
`--new-tokens` each, as batch-1 calls and as one batch, left to right and native (`--steps`);
BD3-LM with `--bd3lm-block-size`. `--unconditional`: instead, `--batch` unconditional samples of
`--seq-length` tokens in one call per family (native, T = `--steps`; AR one token a call), as
`bench_gpu_generation.py` times them, and each version's peak memory above its start
(`memory_peak.AllocatedPeak`, one untimed run). Tokens/s from the median process CPU time of `--repeats`
rounds; `same` says whether the two versions produced the same tokens (they may differ where
float32 logits computed over fewer rows round differently).

    git worktree add /tmp/previous COMMIT
    python benchmarks/bench_sampler_versions.py /tmp/previous [--repeats 5] [--vocab 4097] [--bd3lm-block-size 8]
        [--unconditional] [--json out.json]
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import statistics
import sys

import harness
import torch
from bench_batched_generation import NO_EOS, build_bd3lm
from bench_samplers import FAMILIES, build
from memory_peak import AllocatedPeak

MODULES = ("conditional", "generate", "config")  # what the workloads call


def load_sampling(checkout: str, name: str = "baseline_sampling") -> dict:
    """`checkout`'s sampling modules (`MODULES`), imported inside a package `name` made of that
    checkout's `megatron_dllm/sampling/` files (its relative imports resolve there; the rest of
    megatron_dllm is this checkout's)."""
    path = os.path.join(checkout, "megatron_dllm", "sampling")
    if not os.path.isfile(os.path.join(path, "conditional.py")):
        sys.exit(f"{checkout}: expected a checkout of this repository (no megatron_dllm/sampling/conditional.py)")
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
    package.__path__ = [path]
    sys.modules[name] = package
    return {m: importlib.import_module(f"{name}.{m}") for m in MODULES}


def generate(modules, protocol: str, batched: bool, inf, prompts, seeds, new_tokens: int, kw: dict) -> list:
    """Conditional generation for every prompt: one batched call, or a batch-1 call per prompt."""
    fn = getattr(modules["conditional"], ("generate_left_to_right" if protocol == "left-to-right"
                                          else "generate_native") + "_batch" * batched)
    with torch.no_grad():
        if batched:
            return fn(inf, prompts, new_tokens, NO_EOS, seeds=seeds, **kw)
        return [fn(inf, p, new_tokens, NO_EOS, seed=s, **kw) for p, s in zip(prompts, seeds)]


def unconditional(modules, inf, batch: int, length: int, steps: int) -> list:
    """`batch` unconditional samples of `length` tokens in one call (native, T = `steps`), no EOS stop."""
    cfg = modules["config"].SamplingConfig(steps=steps, seq_length=length, eos_id=0, stop_at_eos=False)
    return modules["generate"].generate(inf, cfg, num_samples=batch, seed=0).tolist()


def alternate(versions: dict, repeats: int, fn, *args) -> tuple[dict, bool]:
    """Each version's process CPU seconds of `fn(modules, *args)` over `repeats` alternating rounds
    (after one that warms up), and whether the two versions gave the same output."""
    cpus, outs = {v: [] for v in versions}, {}
    for r in range(repeats + 1):
        for v in versions if r % 2 else reversed(list(versions)):
            _, cpu, outs[v] = harness.timed(fn, versions[v], *args)
            if r:
                cpus[v].append(cpu)
    return cpus, outs["baseline"] == outs["current"]


def unconditional_row(versions: dict, inf, family: str, args) -> dict:
    """Both versions' unconditional tokens/s (alternating rounds) and peak memory (one untimed run
    each: the dispatch mode slows every operation), printed as a table row."""
    work = (inf, args.batch, args.seq_length, args.steps)
    cpus, same = alternate(versions, args.repeats, unconditional, *work)
    rate = {v: args.batch * args.seq_length / statistics.median(c) for v, c in cpus.items()}
    peak = {}
    for v, modules in versions.items():
        with AllocatedPeak() as allocated:
            unconditional(modules, *work)
        peak[v] = allocated.extra / 2 ** 20
    print(f"| {family} | unconditional, L = {args.seq_length} | batch {args.batch} | {rate['baseline']:.1f} | "
          f"{rate['current']:.1f} | {rate['current'] / rate['baseline']:.2f}x | {'yes' if same else 'NO'} | "
          f"{peak['baseline']:.0f} | {peak['current']:.0f} |", flush=True)
    return {"cpus": cpus, "rate": rate, "same": same, "peak_mib": peak}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("checkout", help="a checkout of another commit (git worktree add DIR COMMIT)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--bd3lm-block-size", type=int, default=0, help="also BD3-LM with blocks of B (0: not run)")
    ap.add_argument("--families", nargs="*", choices=FAMILIES, default=FAMILIES)
    ap.add_argument("--vocab", type=int, default=4097, help="vocabulary of the random models (not BD3-LM's)")
    ap.add_argument("--unconditional", action="store_true",
                    help="time --batch unconditional samples of --seq-length tokens instead (native, T = --steps)")
    args = harness.parse_args(ap, repeats=5)
    versions = {"baseline": load_sampling(args.checkout),
                "current": {m: importlib.import_module(f"megatron_dllm.sampling.{m}") for m in MODULES}}
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(8, 48, args.batch).round().long().tolist()
    prompts = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in lengths]
    seeds = list(range(args.batch))
    tokens = args.batch * args.new_tokens
    workload = (f"{args.batch} unconditional samples of {args.seq_length} tokens" if args.unconditional else
                f"{args.batch} prompts (8-48 tokens), context {args.seq_length}, {args.new_tokens} new tokens per row")
    print(f"## {args.checkout} (baseline) vs this checkout (current): V = {args.vocab}, {workload}, native "
          f"T = {args.steps}, torch threads {args.threads}, CPU tokens/s, median of {args.repeats} alternating rounds")
    peak_columns = " peak MiB, baseline | peak MiB, current |" if args.unconditional else ""
    print(f"| family | protocol | calls | baseline | current | current / baseline | same |{peak_columns}\n"
          f"|---|---|---|---|---|---|---|{'---:|---:|' if args.unconditional else ''}")
    results = {}
    for family in list(args.families) + ["bd3lm"] * bool(args.bd3lm_block_size):
        inf = (build_bd3lm(args.seq_length, args.bd3lm_block_size) if family == "bd3lm"
               else build(family, args.seq_length, args.vocab))
        if args.unconditional:
            results[f"{family}/unconditional"] = unconditional_row(versions, inf, family, args)
            continue
        for protocol in ["left-to-right"] + ["native"] * (family != "ar"):
            kw = {"greedy": False} if protocol == "left-to-right" else {"steps": args.steps}
            for batched in (False, True):
                cpus, same = alternate(versions, args.repeats, generate, protocol, batched, inf, prompts, seeds,
                                       args.new_tokens, kw)
                rate = {v: tokens / statistics.median(c) for v, c in cpus.items()}
                label = "batched" if batched else "batch-1 loop"
                results[f"{family}/{protocol}/{label}"] = {"cpus": cpus, "rate": rate, "same": same}
                print(f"| {family} | {protocol} | {label} | {rate['baseline']:.1f} | {rate['current']:.1f} | "
                      f"{rate['current'] / rate['baseline']:.2f}x | {'yes' if same else 'NO'} |", flush=True)
    harness.write_json(args, prompt_lengths=lengths, results=results)


if __name__ == "__main__":
    main()
