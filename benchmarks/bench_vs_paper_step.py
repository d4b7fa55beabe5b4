"""The paper's own DiT training step against this project's, one after the other on one GPU.

    python benchmarks/bench_vs_paper_step.py --paper-code PATH [--preset 1.7B] [--vocab 32001 131072]
        [--seq 2048] [--micro-batches 2 max] [--max-micro-batch 32] [--ours sdpa sdpa+graph sdpa+fp8]
        [--steps 10] [--warmup 3] [--rounds 2] [--peak-tflops 989.4]

PATH is a checkout of the paper's public code (its `models/dit.py` is imported from there at run
time, never copied; it needs `einops`, `omegaconf` and `huggingface_hub`).

Variants, each timed over `--steps` steps after `--warmup` ones, in rounds (paper, ours..., then
the same again) so drift in clocks or temperature shows as a spread rather than a bias:

* paper — its `DiT` (bidirectional, adaLN, dropout 0.0 as in its training scripts) with its own
  compiled FlexAttention and its inner bf16 autocast, under the bf16 autocast that Lightning's
  `precision: bf16` puts around the step; the MDLM loss as its `MDLM.nll_per_token` computes it
  ([MASK] logit set to -inf, cross-entropy over the masked positions, weight 1/t, token mean);
  `clip_grad_norm_(1.0)` and `torch.optim.AdamW` with its hyper-parameters.
* ours: `sdpa`, `local`, `sdpa+fp8`, ... — `bench_train_step.MegatronStep`, the trainer's own
  step (megatron DDP, megatron's optimizer, the schedule, the family loss) in bf16 with that core
  attention backend and the fusion defaults the trainer uses on a GPU (compiled elementwise
  regions, fused bias-GELU, gradient-accumulation fusion); `+fp8` adds TransformerEngine linears
  with `--fp8-format hybrid` (tensorwise scaling), `+full` full recompute, `+selective` selective
  recompute (core attention), `+layernorm` and `+mlp` what `--recompute-modules` recomputes,
  `+graph` the trainer's full-iteration CUDA graph (captured at the second step, so in the
  micro-batch search too; not with `+fp8` or recompute, which the trainer refuses with it).

Micro-batches: `2` is the paper's 1.7B setting (2 sequences per GPU); `max` is the largest power of
two up to `--max-micro-batch` that fits. Reported: tokens/s, model TFLOP/s and MFU in both FLOP
conventions of `megatron_dllm/scaling/flops.py` (`calflops`: the paper's, no attention-score
matmuls; `full`: every matmul), peak allocated memory, and each variant's tokens/s over the
paper's at the same micro-batch setting. If the paper's code raises (other than running out of
memory), its row gives the error on one line, its traceback goes to stderr, and ours still run;
a variant of ours that raises gets the same, the others still run, and the script exits 1 at the
end.

Without a GPU the script only checks a command (a cpu-* preset, fp32, no micro-batch search): it
imports the paper's `models/dit.py` and runs this project's variants, not the paper's step, whose
FlexAttention has no backward on a CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_train_step import OPT, MegatronStep, make_batch  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.config.model import RECOMPUTE_MODULES  # noqa: E402
from megatron_dllm.families import get_family  # noqa: E402
from megatron_dllm.model.attention import ATTENTION_BACKENDS, TE_BACKENDS  # noqa: E402
from megatron_dllm.model.constants import COND_DIM  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402
from megatron_dllm.scaling.flops import train_flops_per_sequence  # noqa: E402

# MegatronStep's recompute: every layer (uniform, 1 per group) | core attention | the modules named
RECOMPUTE = ("full", "selective", *RECOMPUTE_MODULES)


def load_paper_dit(path: str):
    """The paper code's `models/dit.py` as a module, imported from the user's checkout."""
    source = os.path.join(path, "models", "dit.py")
    if not os.path.isfile(source):
        raise SystemExit(f"error: --paper-code {path}: expected the paper's code checkout with models/dit.py")
    spec = importlib.util.spec_from_file_location("paper_dit", source)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: {source} needs the package {e.name!r} (pip install einops omegaconf "
                         f"huggingface_hub)") from None
    return module


class PaperStep:
    """The paper code's MDLM training step on its own DiT (see the module docstring)."""

    def __init__(self, dit_module, preset, vocab: int, seq: int, inp, mask_id: int):
        config = {"model": {"length": seq, "hidden_size": preset.hidden_size, "cond_dim": COND_DIM,
                            "n_blocks": preset.num_layers, "n_heads": preset.num_attention_heads,
                            "dropout": 0.0, "scale_by_sigma": True},
                  "algo": {"causal_attention": False, "adaLN": True}}
        self.model = dit_module.DiT(config, vocab).to(platform.device())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=OPT["lr"], weight_decay=OPT["weight_decay"],
                                           betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"])
        self.inp, self.mask_id = inp, mask_id

    def __call__(self) -> float:
        inp = self.inp
        with torch.autocast(platform.device().type, dtype=torch.bfloat16):
            logits = self.model(inp.input_ids, inp.sigma)
            logits[:, :, self.mask_id] = float("-inf")
            masked = inp.input_ids == self.mask_id
            nll = F.cross_entropy(logits[masked], inp.targets[masked], reduction="none")
            weight = (1 / inp.t)[:, None].expand_as(masked)[masked]
            loss = (nll * weight).sum() / inp.valid.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPT["clip_grad"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def our_options(variant: str) -> dict:
    """MegatronStep's options for an `--ours` variant BACKEND[+fp8][+full|+selective|+MODULE...][+graph]
    (MODULE: what `--recompute-modules` takes, e.g. sdpa+layernorm+mlp)."""
    backend, *extras = variant.split("+")
    unknown = set(extras) - {"fp8", "graph", *RECOMPUTE}
    if unknown or backend not in ATTENTION_BACKENDS:
        what = f"option {sorted(unknown)[0]!r}" if unknown else f"backend {backend!r}"
        expected = f"BACKEND[+fp8][+full|+selective|+{'|+'.join(RECOMPUTE_MODULES)}...][+graph]"
        raise SystemExit(f"error: --ours {variant}: unknown {what} (expected {expected}, BACKEND one of "
                         f"{', '.join(ATTENTION_BACKENDS)})")
    fp8, graph = "fp8" in extras, "graph" in extras
    if (fp8 or backend in TE_BACKENDS) and not platform.HAS_TE:
        raise SystemExit(f"error: --ours {variant} needs TransformerEngine on a CUDA GPU (not importable here)")
    recompute = "+".join(e for e in extras if e in RECOMPUTE) or None  # bench_train_step.run_config's setting
    if graph and (fp8 or recompute or backend in TE_BACKENDS):
        raise SystemExit(f"error: --ours {variant}: the full-iteration CUDA graph takes neither TransformerEngine "
                         "nor recompute (the trainer refuses them together)")
    kwargs = {"fp8": "hybrid", "fp8_recipe": "tensorwise"} if fp8 else {}
    if backend in TE_BACKENDS:
        kwargs["transformer_impl"] = "transformer_engine"
    return {"attention_backend": backend, "recompute": recompute, "cuda_graph": graph, **kwargs}


def build(variant: str, paper, preset, family, vocab: int, batch: int, seq: int, steps: int):
    inp = make_batch(family, vocab, batch, seq).to(platform.device())
    if variant == "paper":
        return PaperStep(paper, preset, vocab, seq, inp, family.mask_id)
    return MegatronStep(preset, vocab, batch, seq, family, inp, train_iters=10 * steps, keep_initial=False,
                        bf16=True, **our_options(variant))


def measure(variant: str, paper, preset, family, vocab: int, batch: int, seq: int, steps: int, warmup: int):
    """(median seconds per step, peak bytes, last loss); raises out of memory."""
    step = None
    try:
        platform.release_cached_memory()
        platform.reset_peak_memory()
        # the paper's errors become harness.PaperFailed: its row says so and ours still run
        with harness.papers_code() if variant == "paper" else contextlib.nullcontext():
            step = build(variant, paper, preset, family, vocab, batch, seq, steps)
            for _ in range(warmup):
                loss = step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                loss = step()  # both steps return once their kernels (the optimizer's too) have finished
                times.append(time.perf_counter() - start)
        return statistics.median(times), platform.peak_memory()[0], loss
    finally:
        del step
        platform.release_cached_memory()


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is running out of memory on a device where that raises (a GPU), so a smaller
    micro-batch may fit; on the CPU the process would be killed instead, and nothing is searched."""
    return platform.out_of_memory_raises(platform.device()) and platform.is_out_of_memory(err)


def largest_fitting(variant, paper, preset, family, vocab, seq, args) -> int | None:
    found = platform.halve_until_it_fits(
        lambda b: measure(variant, paper, preset, family, vocab, b, seq, steps=1, warmup=1), args.max_micro_batch)
    return found and found[0]


def compare(variants: list[str], paper, preset, vocab: int, setting: str, args) -> list[str]:
    """Print a row per variant at one vocabulary and micro-batch setting (an integer or `max`), the
    variants measured in turn for `args.rounds` rounds. A variant that does not fit, the paper's
    step whose code failed (`harness.PaperFailed`), or one of ours that raised (its traceback to
    stderr), gets a row that says so; the others still run. Returns our variants that raised."""
    family = get_family("mdlm", vocab - 1, vocab)
    flops = {c: train_flops_per_sequence(preset, vocab, args.seq, c) for c in ("calflops", "full")}
    failed, batches, results = {}, {}, {v: [] for v in variants}

    def attempt(v: str, run):
        """run() for variant v, or None: out of memory, or a failure noted in the variant's row."""
        try:
            return run()
        except harness.PaperFailed as err:  # its traceback is on stderr already
            failed[v] = str(err)
        except Exception as err:
            if not out_of_memory(err):
                traceback.print_exc(file=sys.stderr)
                failed[v] = f"failed: {harness.table_cell_error(err)}"
        return None

    for v in variants:
        batches[v] = int(setting) if setting != "max" else \
            attempt(v, lambda v=v: largest_fitting(v, paper, preset, family, vocab, args.seq, args))
    for _ in range(args.rounds):
        for v in variants:
            if batches[v]:
                result = attempt(v, lambda v=v: measure(v, paper, preset, family, vocab, batches[v], args.seq,
                                                        args.steps, args.warmup))
                batches[v] = batches[v] if result else None
                results[v] += [result] if result else []
    paper_rate = None
    for v in variants:
        if v in failed or not results[v] or not batches[v]:
            print(f"| {vocab} | {v} | {setting}: {failed.get(v, 'does not fit')} | | | | | | | | | |", flush=True)
            continue
        sec = statistics.median(r[0] for r in results[v])
        peak = max(r[1] for r in results[v])
        rate = batches[v] * args.seq / sec
        paper_rate = rate if v == "paper" else paper_rate
        tf = {c: batches[v] * f / sec / 1e12 for c, f in flops.items()}
        ratio = f"{rate / paper_rate:.2f}" if paper_rate else "n/a"
        print(f"| {vocab} | {v} | {batches[v]} ({setting}) | {sec * 1e3:.0f} | {rate:,.0f} | {ratio} "
              f"| {tf['calflops']:.0f} | {tf['calflops'] / args.peak_tflops:.1%} | {tf['full']:.0f} "
              f"| {tf['full'] / args.peak_tflops:.1%} | {peak / 2**30:.1f} | {results[v][-1][2]:.3f} |", flush=True)
    return [v for v in failed if v != "paper"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--paper-code", required=True, help="checkout of the paper's code (models/dit.py)")
    p.add_argument("--preset", default="1.7B")
    p.add_argument("--vocab", type=int, nargs="+", default=[32001, 131072],
                   help="real vocabularies including [MASK] (32,001: the paper's scaling runs; 131,072: Nemotron)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batches", nargs="+", default=["2", "max"], help="integers and/or 'max'")
    p.add_argument("--max-micro-batch", type=int, default=32)
    p.add_argument("--ours", nargs="+", default=["sdpa", "sdpa+fp8"] if platform.HAS_TE else ["sdpa"],
                   help="BACKEND[+fp8][+full|+selective|+layernorm|+mlp][+graph] per variant of this project's step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the paper's compile happens here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak (H100 SXM: 989.4)")
    args = p.parse_args(argv)
    for variant in args.ours:
        if our_options(variant)["cuda_graph"] and args.warmup < 2:  # a bad variant: one error line first
            p.error(f"--ours {variant} needs --warmup 2 or more (the first step runs eagerly, the second captures)")
    if not platform.HAS_CUDA and not args.preset.startswith("cpu-"):
        p.error(f"measures a CUDA GPU; without one it only checks the command, with a cpu-* preset "
                f"(got {args.preset})")
    paper = load_paper_dit(args.paper_code)
    preset = get_preset(args.preset)
    platform.init_distributed(1, 1, seed=0)
    # The paper's FlexAttention has no backward on a CPU: there its variant is only imported.
    variants = ["paper", *args.ours] if platform.HAS_CUDA else list(args.ours)
    device = platform.device_name() or "CPU (a check of the command, not a measurement: fp32, no search; the " \
                                       "paper's step needs CUDA, its FlexAttention has no CPU backward)"
    print(f"{device}, torch {torch.__version__}, preset {args.preset} "
          f"(hidden {preset.hidden_size}, {preset.num_layers} layers, {preset.num_attention_heads} heads), "
          f"seq {args.seq}, {args.warmup} warm-up + {args.steps} timed steps (median), {args.rounds} rounds\n")
    print("| vocab | variant | micro-batch | step (ms) | tokens/s | x paper | TFLOP/s calflops | MFU calflops "
          "| TFLOP/s full | MFU full | peak memory (GiB) | loss |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    failed = []
    try:
        for vocab in args.vocab:
            for setting in args.micro_batches:
                failed += compare(variants, paper, preset, vocab, setting, args)
    finally:
        platform.destroy_distributed()
    if failed:
        sys.exit(f"error: --ours {' '.join(dict.fromkeys(failed))} raised (the rows above say what; tracebacks "
                 "on stderr)")


if __name__ == "__main__":
    main()
