#!/usr/bin/env python
"""LITPKDS -> Megatron `.bin/.idx` conversion throughput, side by side with reading and copying
the same files.

    python benchmarks/bench_convert_litpkds.py [--tokens 64e6] [--repeats 5]  # figures: RESULTS.md

Corpus: synthetic packed files as lit-gpt's builder writes them (documents back to back, each
ending with EOS; TinyLlama's chunk of 2049 x 1024 tokens, one chunk per file), document lengths
drawn from a log-normal with a median of ~400 tokens (web-text-like). Two dtypes: uint16 (a 32k
vocabulary, the paper's SlimPajama runs) and int32 (a 128k vocabulary, its Nemotron runs).

Variants, timed in interleaved rounds (the order rotates each round) with a warm page cache:
  read     np.fromfile of every file (the bytes any conversion must read)
  copy     read + write the tokens to one file and fsync it (the least a conversion must do)
  convert  `convert_litpkds` (split at EOS, id checks, .idx, rename; synced for a resume every 10 s)
  convert_sync0  the same, synced after every file (`--sync-interval 0`)
The median over rounds of each variant's time is reported, with convert / read and convert /
copy taken within each round.
"""

import argparse
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time

import harness
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_dllm.data.prep import litpkds  # noqa: E402

CHUNK = 2049 * 1024
EOS = 2


def write_corpus(directory: str, tokens: int, dtype, vocab: int, seed: int = 0) -> list:
    """lit-gpt's packing of random documents into `tokens // CHUNK` full chunk files."""
    rng = np.random.default_rng(seed)
    n_files = max(1, int(tokens) // CHUNK)
    stream = np.empty(n_files * CHUNK, dtype=dtype)
    pos = 0
    while pos < stream.size:
        lengths = np.maximum(1, rng.lognormal(np.log(400), 1.0, 4096).astype(np.int64))
        ids = rng.integers(3, vocab, int(lengths.sum()), dtype=np.int64).astype(dtype)
        ids[np.cumsum(lengths) - 1] = EOS
        take = min(ids.size, stream.size - pos)
        stream[pos:pos + take] = ids[:take]
        pos += take
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(dtype)]
    paths = []
    for i in range(n_files):
        path = os.path.join(directory, f"{i % 256}_bench_{i:05d}.bin")
        with open(path, "wb") as f:
            f.write(b"LITPKDS" + struct.pack("<QBQ", 1, code, CHUNK))
            f.write(stream[i * CHUNK:(i + 1) * CHUNK].tobytes())
        paths.append(path)
    return paths


def read_all(paths, dtype) -> int:
    n = 0
    for p in paths:
        n += np.fromfile(p, dtype=dtype, offset=litpkds.HEADER_SIZE).size
    return n


def copy_all(paths, dtype, out: str) -> None:
    with open(out, "wb") as f:
        for p in paths:
            f.write(np.fromfile(p, dtype=dtype, offset=litpkds.HEADER_SIZE).tobytes())
        f.flush()
        os.fsync(f.fileno())


def bench(directory: str, tokens: int, dtype, vocab: int, repeats: int) -> dict:
    src = os.path.join(directory, np.dtype(dtype).name)
    os.makedirs(src)
    paths = write_corpus(src, tokens, dtype, vocab)
    out = os.path.join(directory, "out")
    quiet = dict(log=lambda m: None, progress=False)
    stats = litpkds.convert_litpkds([src], out, EOS, vocab_size=vocab, overwrite=True, **quiet)  # warm-up, page cache
    variants = {
        "read": lambda: read_all(paths, dtype),
        "copy": lambda: copy_all(paths, dtype, out + ".copy"),
        "convert": lambda: litpkds.convert_litpkds([src], out, EOS, vocab_size=vocab, overwrite=True, **quiet),
        "convert_sync0": lambda: litpkds.convert_litpkds([src], out, EOS, vocab_size=vocab, overwrite=True,
                                                         sync_interval=0,
                                                         **quiet),
    }
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    shutil.rmtree(src)
    for p in (out + ".bin", out + ".idx", out + ".copy"):
        os.remove(p)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"dtype": np.dtype(dtype).name, "vocab": vocab, "files": len(paths), "tokens": stats.tokens_read,
            "documents": stats.documents, "mb": stats.tokens_read * np.dtype(dtype).itemsize / 1e6,
            **{f"t_{k}": v for k, v in med.items()},
            "convert/read": statistics.median(c / r for c, r in zip(times["convert"], times["read"])),
            "convert/copy": statistics.median(c / r for c, r in zip(times["convert"], times["copy"])),
            "sync0/convert": statistics.median(c / r for c, r in zip(times["convert_sync0"], times["convert"]))}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=64e6, help="tokens per corpus (whole chunks of 2049 x 1024)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=harness.existing_dir, default=None,
                   help="where the corpora are written (default: a temporary directory)")
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}; median of {args.repeats} interleaved rounds\n")
    print("| dtype (vocabulary) | files | tokens | documents | MB | read s | copy s | convert s | "
          "convert tokens/s | convert / read | convert / copy | sync every file s | sync every file / convert |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, vocab in ((np.uint16, 32001), (np.int32, 131072)):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            r = bench(d, int(args.tokens), dtype, vocab, args.repeats)
        print(f"| {r['dtype']} ({r['vocab']}) | {r['files']} | {r['tokens']} | {r['documents']} | {r['mb']:.0f} | "
              f"{r['t_read']:.3f} | {r['t_copy']:.3f} | {r['t_convert']:.3f} | "
              f"{r['tokens'] / r['t_convert']:,.0f} | {r['convert/read']:.2f}x | {r['convert/copy']:.2f}x | "
              f"{r['t_convert_sync0']:.3f} | {r['sync0/convert']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
