#!/usr/bin/env python
"""Preprocessing throughput on the real demo corpus, and what it means for 2.1T tokens.

    python benchmarks/bench_preprocess.py [--repeat 3] [--copies 2] [--out results.md]  # figures: RESULTS.md

Corpus: the 42 Shakespeare plays (demo corpus), one JSONL document per paragraph block, copied
`--copies` times (written as `--files` JSONL files). Tokenizers: the demo's 4096-piece
SentencePiece BPE, and a tiktoken-format BPE (2000 ranks, trained with `tokenizers` on the
plays and converted; Llama 3 regex). Each configuration runs in a fresh subprocess
(`tools/preprocess_data.py`), timed end to end (startup, reading, tokenizing, writing,
finalizing), best of `--repeat`; peak RSS = max over the run of the process plus its
children (psutil, sampled every 20 ms). Extrapolation: machine-hours for 2.1e12 tokens at the
measured tokens/s per core, and the machines of N cores for a 24-hour turnaround.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dllm.data.prep.demo import prepare_demo_corpus, shakespeare_files  # noqa: E402
from megatron_dllm.data.prep.tiktoken_files import write_tiktoken_from_bytelevel  # noqa: E402

TARGET_TOKENS = 2.1e12


def _corpus(directory, copies, files):
    docs = []
    for f in shakespeare_files():
        text = open(f, encoding="utf-8").read()
        docs += [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    docs = docs * copies
    per = (len(docs) + files - 1) // files
    paths = []
    for i in range(files):
        path = os.path.join(directory, f"part{i:03d}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in docs[i * per:(i + 1) * per]:
                f.write(json.dumps({"text": d}) + "\n")
        paths.append(path)
    return paths, len(docs)


def _tiktoken(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    docs = [open(f, encoding="utf-8").read() for f in shakespeare_files()[:10]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(directory, "shakespeare2000.tiktoken")
    write_tiktoken_from_bytelevel(path, tok.get_vocab())
    return path


def _run(cmd):
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    proc, peak = psutil.Process(p.pid), 0
    while p.poll() is None:
        try:
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode:
        raise RuntimeError(f"{cmd} failed:\n{err}")
    return time.time() - t0, peak, out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = ap.parse_args()
    demo = prepare_demo_corpus()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        inputs, n_docs = _corpus(d, args.copies, args.files)
        in_bytes = sum(os.path.getsize(p) for p in inputs)
        tiktoken = _tiktoken(d)
        configs = [("SentencePiece 4096 (demo)", "SentencePieceTokenizer", demo["tokenizer_model"]),
                   ("tiktoken BPE 2000 (llama3 regex)", "TikTokenizer", tiktoken)]
        for name, ttype, model in configs:
            for workers in (1, 2):
                best = None
                for r in range(args.repeat):
                    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
                           *inputs, "--output-prefix", os.path.join(d, f"out{r}"), "--tokenizer-type", ttype,
                           "--tokenizer-model", model, "--append-eod", "--workers", str(workers), "--no-progress",
                           "--overwrite"]
                    secs, peak, out = _run(cmd)
                    tokens = int(out.split("tokens written: ")[1].split()[0])
                    if best is None or secs < best[0]:
                        best = (secs, peak, tokens)
                secs, peak, tokens = best
                rows.append(dict(tokenizer=name, workers=workers, seconds=secs, tokens=tokens,
                                 tok_s=tokens / secs, mb_s=in_bytes / secs / 1e6, peak_rss_mb=peak / 2**20))
                print(json.dumps(rows[-1]), flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        model_name = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")][0]
    except (OSError, IndexError):
        model_name = cpu
    lines = [
        "# Preprocessing throughput (tools/preprocess_data.py)",
        "",
        f"Measured by `benchmarks/bench_preprocess.py --repeat {args.repeat} --copies {args.copies} --files "
        f"{args.files}` on {os.cpu_count()} CPU cores ({model_name}), Python {platform.python_version()}.",
        f"Corpus: the 42 Shakespeare plays ×{args.copies} copies, {n_docs} paragraph documents in all, in "
        f"{args.files} JSONL files ({in_bytes / 1e6:.1f} MB); `--append-eod`; end-to-end wall time of a fresh "
        f"process (startup, read, tokenize, write, finalize), best of {args.repeat}; peak RSS of the process "
        f"and its worker processes together.",
        "",
        "| tokenizer | workers | tokens | seconds | tokens/s | MB/s of JSONL | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['workers']} | {r['tokens']} | {r['seconds']:.2f} | "
                     f"{r['tok_s']:,.0f} | {r['mb_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "## Extrapolation to 2.1T tokens (the paper's 1.7B runs)", "",
              "Assumptions: throughput per core is the 1-worker figure (one tokenizer process per core; the "
              "2-worker runs on this 2-core machine share the cores with the reader/writer process, so they "
              "show the parallel overhead, not extra cores); scaling across cores and machines is linear, "
              "which the sharding makes plausible (shards share nothing until the merge); the real corpus "
              "tokenizes like Shakespeare per token (web text with a 128k vocabulary gives more bytes per "
              "token, so tokens/s is, if anything, pessimistic for the byte-bound parts); I/O keeps up "
              "(~1 byte of .bin written per 2 input bytes at uint16, 4 bytes/token at int32); "
              "the merge (a streaming copy, disk-bound) and the decompression of .zst inputs are not included.",
              "",
              "| tokenizer | tokens/s per core | core-hours for 2.1T | 32-core machine-hours | "
              "32-core machines for 24 h | 64-core machines for 24 h | 128-core machines for 24 h |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["workers"] != 1:
            continue
        core_h = TARGET_TOKENS / r["tok_s"] / 3600
        need = lambda cores, core_h=core_h: -(-core_h // (cores * 24))  # noqa: E731
        lines.append(f"| {r['tokenizer']} | {r['tok_s']:,.0f} | {core_h:,.0f} | {core_h / 32:,.0f} | "
                     f"{need(32):,.0f} | {need(64):,.0f} | {need(128):,.0f} |")
    lines += ["", "The same by input bytes, for a 128k vocabulary (about 4.5 bytes of text per token on English "
              "web text, i.e. 9.5 TB of JSONL for 2.1T tokens) if the per-core MB/s measured here holds "
              "(BPE cost grows with bytes, not tokens; a 128k vocabulary was not available offline to "
              "measure — this is the weaker estimate):", "",
              "| tokenizer | MB/s per core | core-hours for 9.5 TB | 32-core machines for 24 h | "
              "64-core machines for 24 h |", "|---|---|---|---|---|"]
    for r in rows:
        if r["workers"] != 1:
            continue
        core_h = 4.5 * TARGET_TOKENS / (r["mb_s"] * 1e6) / 3600
        lines.append(f"| {r['tokenizer']} | {r['mb_s']:.2f} | {core_h:,.0f} | {-(-core_h // (32 * 24)):,.0f} | "
                     f"{-(-core_h // (64 * 24)):,.0f} |")
    lines += ["", "Notes: with 2 workers on this 2-core machine the reader/writer process competes with the two "
              "tokenizer processes for the cores; for tiktoken (very fast Rust BPE, small vocabulary) the "
              "pickling of records to the workers then costs more than it saves, so on few cores "
              "`--workers 1` is best for tiktoken. On a many-core machine use workers = cores - 1, or run "
              "several shards per machine (one `--workers 1` process per core), which avoids the IPC "
              "entirely. At these rates the CPU is not the bound at 2.1T tokens: one day of a single "
              "32-core machine means reading ~9.5 TB of JSONL (~110 MB/s) and writing 8.4 TB of int32 "
              "tokens (~97 MB/s) — the shared filesystem and the decompression of `.zst`/`.gz` inputs "
              "(not measured here) set the real machine count.", ""]
    lines += ["", "Machine-hours at N cores = core-hours / N; machines for 24 h = ceil(core-hours / (24 N)). "
              "With `--num-shards` ≥ machines (e.g. a Slurm array of 256–1024 shards over the corpus files) each "
              "machine takes its byte-balanced share, and `tools/merge_datasets.py` (or a `--blend-file`) joins "
              "the outputs.", ""]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
