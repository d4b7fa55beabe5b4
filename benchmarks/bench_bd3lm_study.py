"""FLOP-matched CPU study: AR, MDLM and BD3-LM at block sizes 4 and 16, trained for the same
training FLOPs on the embedded demo corpus; validation bound and PPL, Gen PPL, entropy and
sampling throughput per model. One command, resumable (a finished step is not run again):

    nice -n 19 python benchmarks/bench_bd3lm_study.py --train-flops 1e12 --out runs/bd3lm-study

Training: `pretrain_dllm.py --train-flops C` per model, one process each, one after another, as
`tools/plan_isoflop.py` plans them (iterations = floor(C / (FLOPs per sample x batch)); a BD3-LM
sample costs the 2L tokens of [x_t ; x_0], so it gets about half the iterations). MDLM trains with
`--loss nelbo`, the same 1/t-weighted bound BD3-LM trains on. The run's last validation is each
family's bound on --eval-iters global batches: AR's exact NLL, the MDLM NELBO, the BD3-LM NELBO.

Sampling at --steps T total denoising steps per sequence: MDLM T, BD3-LM T * B / L per block (the
same model calls when T <= L), AR L (one token per call). Gen PPL: SmolLM2-135M (`--judge none`
skips it). Throughput: `tools/evaluate.py throughput`, batch --sample-batch-size, after a warm-up.
Writes OUT/results.json and OUT/results.md (the table `benchmarks/RESULTS.md` quotes).
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dllm.scaling.plan import budget_label, final_validation, plan_isoflop, series_name  # noqa: E402

DEMO_VOCAB = 4097  # the demo tokenizer's 4096 pieces + [MASK]


def run(cmd: list[str], log: str, env: dict | None = None) -> float:
    """Runs a command with its output in `log`; returns its wall time (s); fails loudly."""
    tick = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - tick


def train(r, args, run_dir: str) -> dict:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    last = final_validation(metrics)
    if last is None or last["iteration"] != r.iterations:
        os.makedirs(run_dir, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": "0", "LOCAL_RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
        if os.path.exists(metrics):
            os.remove(metrics)
        cmd = [sys.executable, "pretrain_dllm.py", "--family", r.family, "--preset", r.preset,
               "--seq-length", str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
               "--micro-batch-size", str(args.global_batch_size), "--train-flops", budget_label(r.budget),
               "--lr", str(args.lr), "--eval-iters", str(args.eval_iters), "--eval-interval", str(r.iterations),
               "--log-interval", "1000", "--seed", str(args.seed), "--metrics-file", metrics,
               "--save", os.path.join(run_dir, "checkpoints"), "--tensorboard-dir", os.path.join(run_dir, "tb")]
        cmd += ["--block-size", str(r.block_size)] if r.block_size else []
        cmd += ["--loss", "nelbo"] if r.family == "mdlm" else []
        seconds = run(cmd, os.path.join(run_dir, "train.log"), env)
        print(f"  trained {r.name}: {r.iterations} iterations in {seconds:.0f} s", flush=True)
        last = final_validation(metrics)
    return {"valid_nelbo": last["valid_nelbo"], "valid_ppl": last["valid_ppl"], "flops": last["flops"]}


def evaluate(r, args, run_dir: str) -> dict:
    """Gen PPL, entropy and throughput at --steps total steps (see the module docstring)."""
    steps = args.seq_length if r.family == "ar" else args.steps
    if r.block_size:
        steps = max(1, args.steps * r.block_size // args.seq_length)
    load = os.path.join(run_dir, "checkpoints")
    samples, gen, speed = (os.path.join(run_dir, f"{name}_T{args.steps}.json")
                           for name in ("samples", "gen_ppl", "throughput"))
    common = ["--steps", str(steps), "--seed", "0"]
    if not os.path.exists(samples):
        run([sys.executable, "tools/sample.py", "--load", load, "--num-samples", str(args.num_samples),
             "--batch-size", str(args.sample_batch_size), "--output", samples, *common], samples + ".log")
    if args.judge != "none" and not os.path.exists(gen):
        run([sys.executable, "tools/evaluate.py", "gen-ppl", "--samples", samples, "--judge", args.judge,
             "--output", gen], gen + ".log")
    if not os.path.exists(speed):
        run([sys.executable, "tools/evaluate.py", "throughput", "--load", load, "--batch-size",
             str(args.sample_batch_size), "--repeats", "2", "--output", speed, *common], speed + ".log")
    out = {"sampling_steps": steps}
    if args.judge != "none":
        with open(gen) as f:
            record = json.load(f)
        out.update(gen_ppl=record["gen_ppl"], entropy=record["entropy"])
    with open(speed) as f:
        out["tokens_per_s"] = json.load(f)["tokens_per_s"]
    return out


def markdown(rows: list[dict], args) -> str:
    lines = [f"Budget {args.train_flops:g} training FLOPs (calflops), `{args.preset}`, L = {args.seq_length}, "
             f"batch {args.global_batch_size}; sampling: {args.num_samples} samples, {args.steps} total steps.", "",
             "| model | iterations | validation bound (nats/token) | PPL | Gen PPL | entropy | sampling steps "
             "| tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        r = {**r, **{k: float("nan") for k in ("valid_nelbo", "valid_ppl") if r.get(k) is None}}  # null: diverged
        gen = f"{r['gen_ppl']:.1f}" if "gen_ppl" in r else "-"
        ent = f"{r['entropy']:.2f}" if "entropy" in r else "-"
        lines.append(f"| {r['model']} | {r['iterations']} | {r['valid_nelbo']:.3f} | {r['valid_ppl']:.1f} | {gen} | "
                     f"{ent} | {r['sampling_steps']} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-flops", type=float, default=1e12, help="the budget every model trains for")
    parser.add_argument("--out", default="runs/bd3lm-study")
    parser.add_argument("--preset", default="cpu-tiny")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-iters", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=64, help="total denoising steps per sequence when sampling")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--sample-batch-size", type=int, default=16)
    parser.add_argument("--judge", default="smollm2", help="the Gen PPL judge (evaluate.py gen-ppl), or none")
    args = parser.parse_args(argv)

    planned, dropped = plan_isoflop([args.train_flops], ["ar", "mdlm", "bd3lm"], [args.preset],
                                    seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                                    vocab_size=DEMO_VOCAB, block_sizes=args.block_sizes)
    if dropped:
        names = ", ".join(r.name for r, _ in dropped)
        sys.exit(f"--train-flops {args.train_flops:g} pays for no iteration of: {names}")
    rows = []
    for r in planned:
        run_dir = os.path.join(args.out, r.name)
        row = {"model": series_name(r.family, r.block_size), "family": r.family, "block_size": r.block_size,
               "iterations": r.iterations, **train(r, args, run_dir)}
        row.update(evaluate(r, args, run_dir))
        rows.append(row)
        print(f"  {row}", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    text = markdown(rows, args)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
