"""MDLM's ancestral sampling: the sampler as it is now (when each position unmasks drawn up front;
the output layer, softmax and race only where positions unmask) beside the previous one (the
logits of every position, a float64 race over q at every masked position, every step), run for
run: time, peak memory, model calls.

`--model fixed` (default): a stand-in that returns one fixed logits tensor [b, L, V] (in
`--logits-dtype`), so what is measured is the sampling arithmetic, not the forward. `--model
dense`: a randomly initialised DiT of `--hidden-size`/`--num-layers` (fp32), the whole sampler as
a user runs it, where the output layer's share of the forward counts too. Both samplers call the
model at the same number of steps in expectation (the no-change cache and the plan skip the same
steps; the counts of this run are printed). Memory: the peak allocated above what was there
(`memory_peak.AllocatedPeak`), in float64 buffers of [b L, V] (8 bytes a logit): the previous
sampler's [masked positions, V] buffers bound the batch a GPU fits. The two draw from the same
distribution, not the same ids. Variants alternate over `--repeats` rounds.

    python benchmarks/bench_mdlm_unmasking.py [--batch 1] [--length 1024] [--vocab 32001] [--steps 16 256]
    python benchmarks/bench_mdlm_unmasking.py --model dense --hidden-size 128 --num-layers 4 --length 128 --vocab 4097
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_peak import AllocatedPeak  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.hf.random_model import random_dense_model  # noqa: E402
from megatron_dllm.sampling import InferenceModel, SamplingConfig, categorical, get_sampler  # noqa: E402


class FixedLogits(torch.nn.Module):
    """A model that answers every forward with the same logits and counts the calls."""

    def __init__(self, logits: torch.Tensor, config):
        super().__init__()
        self.logits, self.config, self.calls = logits, config, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1, device=logits.device))  # the sampler reads the device

    def forward(self, input_ids, logits_at=None, **_):
        self.calls += 1
        return SimpleNamespace(logits=self.logits if logits_at is None else self.logits.flatten(0, 1)[logits_at])


def previous(sampler, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The sampler before: at each step the race over q = [p_x0 (a_s - a_t), [MASK]: 1 - a_s] at
    every masked position, p_x0 kept while a step changes nothing, then the greedy final step."""
    ts = sampler.timesteps()
    p_x0 = None
    for t, s in zip(ts[:-1], ts[1:]):
        masked = x == sampler.mask_id
        if not masked.any():
            break
        if p_x0 is None:
            p_x0 = sampler.probs(sampler.model(input_ids=x).logits[masked])
        a_t, a_s = sampler.alpha(t), sampler.alpha(s)
        q = p_x0 * (a_s - a_t)
        q[:, sampler.mask_id] = 1 - a_s
        new = categorical.sample(q, generator)
        x[masked] = new
        if bool((new != sampler.mask_id).any()):
            p_x0 = None
    masked = x == sampler.mask_id
    if masked.any():
        x[masked] = (p_x0 if p_x0 is not None else sampler.probs(sampler.model(input_ids=x).logits[masked])).argmax(-1)
    return x


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=["fixed", "dense"], default="fixed")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    args = ap.parse_args(argv)
    dev = platform.device()
    mask_id = args.vocab - 1
    if args.model == "fixed":
        config = random_dense_model("mdlm", 8, 8).config  # the sampler reads the layer count only
        logits = torch.randn(args.batch, args.length, args.vocab, device=dev)
        model = FixedLogits((3 * logits).to(getattr(torch, args.logits_dtype)), config)
        what = f"a fixed [{args.batch}, {args.length}, {args.vocab}] logits tensor in {args.logits_dtype}"
    else:
        model = random_dense_model("mdlm", args.vocab, args.length, hidden_size=args.hidden_size,
                                   num_layers=args.num_layers, num_heads=max(1, args.hidden_size // 32)).to(dev)
        model.calls = 0
        model.register_forward_pre_hook(lambda module, inputs: setattr(module, "calls", module.calls + 1))
        what = (f"a random DiT (hidden {args.hidden_size}, {args.num_layers} layers, fp32), batch {args.batch}, "
                f"L {args.length}, V {args.vocab}")
    inf = InferenceModel(model, "mdlm", mask_id, args.vocab, args.length, None, "hf")
    prompt = torch.empty(args.batch, 0, dtype=torch.long, device=dev)
    buffer = args.batch * args.length * args.vocab * 8
    print(f"MDLM ancestral over {what} on {dev}; one float64 buffer of [b L, V]: {buffer / 2**20:.0f} MiB")
    print("| T | sampler | median (s) | min (s) | model calls | extra peak (MiB) | peak / float64 buffer |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    variants = {"previous": lambda sampler, g: previous(sampler, sampler.canvas(prompt), g),
                "now": lambda sampler, g: sampler.sample(prompt, g)}
    for steps in args.steps:
        sampler = get_sampler(inf, SamplingConfig(steps=steps))
        times = {name: [] for name in variants}
        calls, extra = {}, {}
        with torch.no_grad():
            for name, run in variants.items():
                model.calls = 0
                with AllocatedPeak() as peak:
                    run(sampler, torch.Generator(dev).manual_seed(0))
                calls[name], extra[name] = model.calls, peak.extra
            for i in range(args.repeats):
                for name, run in variants.items():
                    t0 = time.perf_counter()
                    run(sampler, torch.Generator(dev).manual_seed(i + 1))
                    platform.synchronize()
                    times[name].append(time.perf_counter() - t0)
        for name in variants:
            print(f"| {steps} | {name} | {statistics.median(times[name]):.3f} | {min(times[name]):.3f} | {calls[name]} "
                  f"| {extra[name] / 2**20:.0f} | {extra[name] / buffer:.2f} |")


if __name__ == "__main__":
    main()
