#!/usr/bin/env python
"""Preprocessing with Megatron-LM's 131k TikTokenizer JSON vocabulary: this project's
tools/preprocess_data.py against Megatron-LM's own, same input, same flags, same workers.

    python benchmarks/bench_preprocess_tiktoken.py --megatron-lm /tmp/mlm [--copies 2] [--workers 1 2] \\
        [--rounds 3] [--out results.md]      # figures: RESULTS.md

`--megatron-lm` is a Megatron-LM tree at tag core_v0.16.1 (`git archive core_v0.16.1 | tar -x`);
it runs through tests/data/megatron_tiktoken/record_megatron.py (which stands in for its one
triton import). Vocabulary: mistral-common's tekken_240911.json "vocab" list (150,000 ranks;
Megatron's defaults keep 130,072 of them after 1000 specials: 131072 ids, int32 output). Corpus:
the 42 Shakespeare plays, one JSONL document per paragraph block, `--copies` times.
Flags: `--tiktoken-pattern v2 --append-eod`.

Each run is a fresh process, timed end to end (startup, read, tokenize, write); the two tools
alternate within each round, so machine load hits both alike. Each round also runs both tools
on a one-document input: that run is the startup (imports, vocabulary load, worker start).
Reported per (tool, workers), medians over rounds: wall seconds and tokens/s per worker
(tokens / wall / workers); CPU seconds (user + sys of the process and its workers,
`RUSAGE_CHILDREN`), tokens per CPU-second end to end and after startup (tokens / (CPU - startup
CPU)). CPU time is what a worker core spends per token, and unlike wall time it does not move
with the machine's load. The ratios are ours over Megatron-LM's within each round, median over
rounds. Both tools' outputs are checked to be byte-identical in every round.
"""
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RUNNER = os.path.join(REPO, "tests", "data", "megatron_tiktoken", "record_megatron.py")
FLAGS = ["--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v2", "--append-eod"]

from megatron_dllm.data.prep.demo import shakespeare_files  # noqa: E402


def _corpus(path: str, copies: int) -> int:
    docs = []
    for f in shakespeare_files():
        text = open(f, encoding="utf-8").read()
        docs += [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for d in docs * copies:
            f.write(json.dumps({"text": d}) + "\n")
    return len(docs) * copies


def _run(cmd, env) -> tuple:
    """(wall seconds, CPU seconds of the process tree) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd[:3])} failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _md5(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--megatron-lm", required=True, help="Megatron-LM tree at tag core_v0.16.1")
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(REPO, "tests", "data", "megatron_tiktoken"))
    from record_megatron import write_vocabulary

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times = {}  # (tool, workers) -> [(wall, cpu, startup wall, startup cpu)]
    ratios = {w: [] for w in args.workers}  # (wall, CPU, CPU after startup)
    with tempfile.TemporaryDirectory() as tmp:
        vocab, corpus = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "corpus.jsonl")
        write_vocabulary(vocab)
        n_docs = _corpus(corpus, args.copies)
        tiny = os.path.join(tmp, "tiny.jsonl")
        with open(corpus, encoding="utf-8") as src, open(tiny, "w", encoding="utf-8") as dst:
            dst.write(src.readline())
        mb = os.path.getsize(corpus) / 1e6
        tokens = None
        for r in range(args.rounds):
            for w in args.workers:
                ours = os.path.join(tmp, f"ours{w}")
                theirs = os.path.join(tmp, f"megatron{w}")

                def cmd(tool, source, prefix, w=w):
                    common = ["--input", source, "--tokenizer-model", vocab, "--workers", str(w), *FLAGS,
                              "--output-prefix", prefix]
                    if tool == "ours":
                        return [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *common,
                                "--no-progress", "--log-interval", "1e9", "--overwrite"]
                    return [sys.executable, RUNNER, "--one", args.megatron_lm, *common, "--log-interval", "100000000"]

                order = ["ours", "megatron"] if r % 2 == 0 else ["megatron", "ours"]
                got = {}
                for tool in order:
                    startup = _run(cmd(tool, tiny, os.path.join(tmp, f"tiny_{tool}")), env)
                    got[tool] = (*_run(cmd(tool, corpus, ours if tool == "ours" else theirs), env), *startup)
                for tool in order:
                    times.setdefault((tool, w), []).append(got[tool])
                m, o = got["megatron"], got["ours"]
                ratios[w].append((m[0] / o[0], m[1] / o[1], (m[1] - m[3]) / max(o[1] - o[3], 1e-9)))
                a, b = ours + "_text_document", theirs + "_text_document"
                if (_md5(a + ".bin"), _md5(a + ".idx")) != (_md5(b + ".bin"), _md5(b + ".idx")):
                    sys.exit(f"error: outputs differ at {w} workers (round {r})")
                tokens = os.path.getsize(a + ".bin") // 4  # int32 ids
                print(f"round {r} workers {w} (wall, CPU, startup s): ours {got['ours']}, "
                      f"megatron {got['megatron']}", file=sys.stderr, flush=True)
                _report(args, times, ratios, n_docs, mb, tokens, r + 1)


def _report(args, times, ratios, n_docs, mb, tokens, rounds) -> None:
    """Print (and write to --out) the table of the rounds done so far."""
    lines = [f"Corpus: {n_docs} paragraph documents, {mb:.1f} MB of JSONL, {tokens} tokens (with EOD); "
             f"{rounds} rounds; {os.cpu_count()} CPU cores, Python {platform.python_version()}.", "",
             "| tool | workers | wall s | tokens/s per worker (wall) | CPU s | startup CPU s | tokens per CPU-s "
             "| after startup | ours/Megatron-LM: wall | CPU | CPU after startup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in [w for w in args.workers if ("ours", w) in times]:
        for tool in ("megatron", "ours"):
            wall, cpu, _, startup_cpu = (statistics.median(t[i] for t in times[(tool, w)]) for i in range(4))
            steady = statistics.median(tokens / max(t[1] - t[3], 1e-9) for t in times[(tool, w)])
            name = "Megatron-LM tools/preprocess_data.py" if tool == "megatron" else "megatron_dllm"
            ratio = "| | | |"
            if tool == "ours":
                ratio = "| " + " | ".join(f"{statistics.median(x[i] for x in ratios[w]):.2f}x" for i in range(3)) + " |"
            lines.append(f"| {name} | {w} | {wall:.1f} | {tokens / wall / w:,.0f} | {cpu:.1f} | {startup_cpu:.1f} "
                         f"| {tokens / cpu:,.0f} | {steady:,.0f} {ratio}")
    harness.publish(lines, args.out)


if __name__ == "__main__":
    main()
