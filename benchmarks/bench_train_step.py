"""One full training step (forward, backward, AdamW step) on CPU: megatron-core vs plain PyTorch.

    python benchmarks/bench_train_step.py [--preset cpu-base] [--vocab 4097] [--batch 8] [--seq 128]
                                          [--attention-backend sdpa] [--repeats 10] [--warmup 3]
                                          [--threads N] [--profile]

Variants, run interleaved (A B C, A B C, ...) after warm-up rounds, in one process:

* megatron      — the trainer's own step at TP=1: the model, DDP, optimizer and LR schedule built
                  by `training.build.build_training_model` from a RunConfig (local layers, the
                  optimizer settings below), and `training.step.train_step`, the function
                  `Trainer.train_step` calls (megatron's schedule with the MDLM family loss,
                  `optimizer.step()`, `scheduler.step()`, the trainer's timers). On CPU this runs
                  under the `TorchFunctionMode` that `platform.install_cpu_compat` leaves active.
* plain         — the dense `DiT` of `hf/modeling_dllm.py` (same weights, real vocabulary), the MDLM loss
                  written densely with `F.cross_entropy`, `clip_grad_norm_` and torch's fused AdamW
                  (the trainer's kernel) with megatron's hyper-parameters and param groups (no decay
                  on biases and norms),
                  with the platform's TorchFunctionMode suspended: plain PyTorch.
* plain+mode    — the same plain step with the TorchFunctionMode active (its cost in isolation).

The megatron step cannot run with the mode suspended: megatron's schedule allocates with
`device="cuda"` (`forward_backward_no_pipelining`), which only the mode redirects.

The batch (tokens and MDLM corruption) is drawn once, outside the timed region. On a shared
machine, rounds during which other processes used the CPU (from /proc/stat) are set aside, and
rounds continue until --repeats undisturbed ones. Prints a markdown table (median and minimum
wall time per step, median process CPU time, each with its ratio to `plain`) and the headline
ratio: the median over undisturbed rounds of megatron/plain within the round.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.checkpoint.identity import ModelIdentity  # noqa: E402
from megatron_dllm.config.model import RECOMPUTE_MODULES  # noqa: E402
from megatron_dllm.families import Noise, get_family  # noqa: E402
from megatron_dllm.hf import export  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402

OPT = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
           clip_grad=1.0)


def mode_off():
    """Suspends every TorchFunctionMode (the platform's CPU device mode) for plain PyTorch."""
    return torch._C.DisableTorchFunction()


def make_batch(family, vocab: int, batch: int, seq: int):
    """`batch` samples for a model of sequence length `seq`, corrupted by `family` (AR's samples
    carry the extra token its inputs and targets are shifted from, as the trainer's datasets)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab - 1, (batch, seq + int(family.extra_token)), generator=gen)
    ids = torch.arange(batch, dtype=torch.int64)
    return family.corrupt(tokens, Noise(seed=0, sample_ids=ids, strata=ids, num_strata=batch))


# ------------------------------------------------------------------------------- megatron path

def recompute_setting(text: str) -> str:
    """An argparse type for a recompute setting: off | full | selective (core attention) | the
    modules to recompute selectively, joined by "+" ("layernorm+mlp")."""
    if text in ("off", "full", "selective") or set(text.split("+")) <= set(RECOMPUTE_MODULES):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected off, full, selective or modules of "
                                     f"{', '.join(RECOMPUTE_MODULES)} joined by '+'")


class FixedBatch:
    """One global batch of one micro-batch, drawn once (the step's `batches` interface)."""

    def __init__(self, inp, batch: int):
        self.inp, self.mbs, self.num_microbatches = inp, batch, 1

    def iteration(self, consumed: int, number: int | None = None):
        return iter([self.inp])


def run_config(preset, batch: int, seq: int, train_iters: int, attention_backend: str | None = None,
               bf16: bool = False, recompute: str | None = None, fp8: str | None = None,
               fp8_recipe: str = "delayed", fusion: str = "default", transformer_impl: str | None = None,
               cuda_graph: bool = False, gradient_accumulation_fusion: bool | None = None,
               timing_log_level: int | None = None, extra_flags: tuple = ()):
    """The RunConfig of the step: `preset`'s sizes, the benchmark's AdamW and LR, `transformer_impl`'s
    layers (default: local, TransformerEngine's with `fp8`). `fusion`: "default" takes the
    platform's fusion defaults (as the trainer does), "none" runs every elementwise operation
    eager, "all" forces the compiled regions and the bias fusions on (masked-softmax fusion stays
    at its default). `cuda_graph`: the full-iteration CUDA graph, captured at the second step.
    `gradient_accumulation_fusion`: on or off (None: the platform's default). `timing_log_level`:
    megatron-core's timers (None: the trainer's default; on a GPU each timer at or below it records
    CUDA events when it starts and stops). `extra_flags`: more of pretrain_dllm.py's flags (the
    GPT backbone's shape)."""
    from megatron_dllm.config import parse_args, validate

    flags = ["--preset", "cpu-micro", "--hidden-size", preset.hidden_size, "--num-layers", preset.num_layers,
             "--num-attention-heads", preset.num_attention_heads, "--seq-length", seq,
             "--micro-batch-size", batch, "--global-batch-size", batch, "--train-iters", train_iters,
             "--seed", 0, "--transformer-impl", transformer_impl or ("transformer_engine" if fp8 else "local"),
             "--lr-warmup-iters", 0,
             "--lr", OPT["lr"], "--min-lr", OPT["min_lr"], "--weight-decay", OPT["weight_decay"],
             "--adam-beta1", OPT["adam_beta1"], "--adam-beta2", OPT["adam_beta2"], "--adam-eps", OPT["adam_eps"],
             "--clip-grad", OPT["clip_grad"]]
    if attention_backend:
        flags += ["--attention-backend", attention_backend]
    if bf16:
        flags.append("--bf16")
    if fp8:
        flags += ["--fp8-format", fp8, "--fp8-recipe", fp8_recipe]
    if recompute == "full":  # megatron-core's full recompute of every layer
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    elif recompute:  # "selective" (core attention), or the modules to recompute joined by "+": "layernorm+mlp"
        flags += ["--recompute-granularity", "selective"]
        if recompute != "selective":
            flags += ["--recompute-modules", *recompute.split("+")]
    if cuda_graph:
        flags += ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--cuda-graph-warmup-steps", 1]
    if fusion == "none":
        flags += ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
                  "--no-compile-elementwise"]
    elif fusion == "all":
        flags += ["--bias-gelu-fusion", "--bias-swiglu-fusion", "--bias-dropout-fusion", "--compile-elementwise"]
    if gradient_accumulation_fusion is not None:
        flags.append(f"--{'' if gradient_accumulation_fusion else 'no-'}gradient-accumulation-fusion")
    if timing_log_level is not None:
        flags += ["--timing-log-level", timing_log_level]
    flags += extra_flags
    return validate(parse_args([str(f) for f in flags]), platform.world_size())  # the launch's rules too


class MegatronStep:
    """The trainer's step: built by `training.build`, run by `training.step.train_step`."""

    def __init__(self, preset, vocab: int, batch: int, seq: int, family, inp, train_iters: int,
                 keep_initial: bool = True, attention_backend: str | None = None, bf16: bool = False,
                 recompute: str | None = None, fp8: str | None = None, fp8_recipe: str = "delayed",
                 fusion: str = "default", transformer_impl: str | None = None, cuda_graph: bool = False,
                 gradient_accumulation_fusion: bool | None = None, timing_log_level: int | None = None,
                 extra_flags: tuple = ()):
        from megatron_dllm.training import observability
        from megatron_dllm.training.build import build_training_model

        self.config = run_config(preset, batch, seq, train_iters, attention_backend, bf16, recompute, fp8,
                                 fp8_recipe, fusion, transformer_impl, cuda_graph, gradient_accumulation_fusion,
                                 timing_log_level, extra_flags)
        self.timers = observability.make_timers(self.config.logging.timing_log_level)  # as the trainer's
        built = build_training_model(self.config, family, vocab, self.timers)
        self.arch, self.model, self.optimizer, self.scheduler = built.arch, built.model, built.optimizer, \
            built.scheduler
        self.graph = built.graph
        self.initial_state = ({k: v.clone() for k, v in self.model[0].module.state_dict().items()
                               if torch.is_tensor(v)} if keep_initial else None)  # the plain step's weights
        self.family, self.inp, self.batches = family, inp, FixedBatch(inp, batch)

    def __call__(self) -> float:
        from megatron_dllm.training.step import train_step

        loss, _ = train_step(self.model, self.optimizer, self.scheduler, self.family, self.batches, 0, self.config,
                             self.timers, graph=self.graph)
        # The loss is read before the optimizer step, whose kernels may still run here: a timed step
        # ends when the device has finished them.
        platform.synchronize()
        return loss


# ------------------------------------------------------------------------------- plain path

class PlainStep:
    def __init__(self, state_dict, preset, vocab: int, seq: int, family, inp):
        identity = ModelIdentity(family.name, preset.hidden_size, preset.num_layers, preset.num_attention_heads,
                                 vocab, family.mask_id)
        self.model = export.hf_model(state_dict, identity, family.attention, seq).backbone
        decay = [p for n, p in self.model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
        no_decay = [p for n, p in self.model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": OPT["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=OPT["lr"], betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"],
            fused=True,  # as the trainer's optimizer (training/optim.py: fuse_adam)
        )
        self.mask_id, self.inp = family.mask_id, inp

    def __call__(self) -> float:
        inp = self.inp
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(inp.input_ids, inp.position_ids, inp.sigma)  # [b, s, V]
        logits[..., self.mask_id] = float("-inf")  # never predict [MASK] (as vocab_parallel.suppress)
        nll = F.cross_entropy(logits.flatten(0, 1), inp.targets.flatten(), reduction="none")
        loss = (nll.view_as(inp.targets) * (inp.input_ids == self.mask_id) * inp.valid).sum() / inp.valid.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPT["clip_grad"])
        self.optimizer.step()
        return loss.item()


# ------------------------------------------------------------------------------- driver

def _system_busy() -> float | None:
    """CPU seconds all processes of this machine have used so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def timed(fn, context) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds over all threads, CPU seconds other processes
    used meanwhile) of one call."""
    with context():
        b0, t0, c0 = _system_busy(), time.perf_counter(), time.process_time()
        fn()
        wall, used, b1 = time.perf_counter() - t0, time.process_time() - c0, _system_busy()
    others = 0.0 if b0 is None else max(0.0, (b1 - b0) - used)
    return wall, used, others


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-base")
    p.add_argument("--vocab", type=int, default=4097, help="real vocabulary including [MASK]")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10, help="undisturbed rounds to collect")
    p.add_argument("--max-rounds", type=int, default=None, help="give up after this many (default 4x)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-diagnostics", action="store_true", help="time only megatron and plain")
    p.add_argument("--profile", action="store_true", help="cProfile + torch.profiler of both steps")
    p.add_argument("--attention-backend", default=None, choices=["local", "sdpa"],
                   help="megatron's core attention (default: the trainer's, local); the plain step's is SDPA")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    platform.init_distributed(1, 1, seed=0)
    try:
        preset = get_preset(args.preset)
        family = get_family("mdlm", args.vocab - 1, args.vocab)
        inp = make_batch(family, args.vocab, args.batch, args.seq)
        max_rounds = args.max_rounds or 4 * args.repeats
        train_iters = args.warmup + max_rounds + 100
        megatron = MegatronStep(preset, args.vocab, args.batch, args.seq, family, inp, train_iters,
                                attention_backend=args.attention_backend)
        plain = PlainStep(megatron.initial_state, preset, args.vocab, args.seq, family, inp)
        loss_m, loss_p = megatron(), plain()  # first step from identical weights: same loss
        print(f"first-step loss: megatron {loss_m:.6f}  plain {loss_p:.6f}", file=sys.stderr)

        variants = {"megatron": (megatron, contextlib.nullcontext), "plain": (plain, mode_off)}
        if not args.no_diagnostics:
            variants["plain+mode"] = (plain, contextlib.nullcontext)
        for _ in range(args.warmup):
            for fn, ctx in variants.values():
                timed(fn, ctx)
        # Interleaved rounds (one step of each variant). A round in which other processes used
        # more than 10% of a core during any of its steps is disturbed: it is kept for the
        # "all rounds" columns only. Rounds continue until --repeats undisturbed ones.
        rounds, clean = [], []
        while len(clean) < args.repeats and len(rounds) < max_rounds:
            r = {name: timed(fn, ctx) for name, (fn, ctx) in variants.items()}
            rounds.append(r)
            if all(others <= 0.1 * wall + 0.02 for wall, _, others in r.values()):
                clean.append(r)
        use = clean or rounds

        def stat(rs, name, i, f=statistics.median):
            return f(r[name][i] for r in rs)

        tokens = args.batch * args.seq
        print(f"\npreset {args.preset} (h={preset.hidden_size}, L={preset.num_layers}, "
              f"heads={preset.num_attention_heads}), vocab {args.vocab} (megatron pads to "
              f"{megatron.arch.padded_vocab_size(1)}; attention {megatron.config.model.attention_backend or 'local'}), "
              f"batch {args.batch} x seq {args.seq}, "
              f"{torch.get_num_threads()} threads, {args.warmup} warm-up rounds, {len(clean)} undisturbed "
              f"of {len(rounds)} interleaved rounds{'' if clean else ' (none undisturbed: all rounds used)'}\n")
        print("| variant | median step (ms) | vs plain | min step (ms) | vs plain | median CPU time (ms) "
              "| vs plain | tokens/s | median step, all rounds (ms) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in variants:
            med, low, cpu = stat(use, name, 0), stat(use, name, 0, min), stat(use, name, 1)
            print(f"| {name} | {med * 1e3:.1f} | {med / stat(use, 'plain', 0):.3f} | {low * 1e3:.1f} | "
                  f"{low / stat(use, 'plain', 0, min):.3f} | {cpu * 1e3:.1f} | "
                  f"{cpu / stat(use, 'plain', 1):.3f} | {tokens / med:,.0f} | "
                  f"{stat(rounds, name, 0) * 1e3:.1f} |")
        ratio = statistics.median(r["megatron"][0] / r["plain"][0] for r in use)
        print(f"\nmegatron / plain = {ratio:.3f} (median over undisturbed rounds of the per-round ratio); "
              f"{stat(use, 'megatron', 0, min) / stat(use, 'plain', 0, min):.3f} (min / min)")

        if args.profile:
            profile(megatron, plain)
    finally:
        platform.destroy_distributed()


def profile(megatron, plain, steps: int = 5) -> None:
    for name, fn, ctx in (("megatron", megatron, contextlib.nullcontext), ("plain", plain, mode_off)):
        prof = cProfile.Profile()
        with ctx():
            prof.enable()
            for _ in range(steps):
                fn()
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"\n### cProfile, {name}, {steps} steps (sorted by tottime)\n```\n{out.getvalue()}\n```")
        with ctx(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            for _ in range(steps):
                fn()
        print(f"\n### torch.profiler, {name}, {steps} steps\n```\n"
              f"{tp.key_averages().table(sort_by='self_cpu_time_total', row_limit=25)}\n```")


if __name__ == "__main__":
    main()
