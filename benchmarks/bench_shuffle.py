"""Eso-LM shuffle: the C++ extension (and the CUDA kernel, where built and a GPU exists) against the
pure-torch reference, side by side.

One call = sort_idx from (is_mask, u) + gathers of z_t, x0 and position ids (what `EsoLM.corrupt`
does); "unpermute" = the inverse scatter of a [B, L, 64] float32 tensor. Keys are float64, as
`Noise.uniform` draws them; about half the tokens are masked. Each backend is timed
`--repeats` times after a warm-up, interleaved, and the median is reported.

    python benchmarks/bench_shuffle.py [--batch 8 64] [--length 2048] [--repeats 21] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_dllm.families import shuffle as S


def _time(fn, sync=lambda: None) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench(B: int, L: int, repeats: int, device: str, backends: list[str]) -> dict:
    gen = torch.Generator().manual_seed(B * L)
    mask = (torch.rand(B, L, generator=gen) < 0.5).to(device)
    u = torch.rand(B, L, generator=gen, dtype=torch.float64).to(device)
    z = torch.randint(0, 32000, (B, L), generator=gen).to(device)
    x0 = torch.randint(0, 32000, (B, L), generator=gen).to(device)
    pos = torch.arange(L, device=device).expand(B, L).contiguous()
    x = torch.randn(B, L, 64, generator=gen).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sort_idx = S.shuffle(mask, u, z, backend="torch")[0]
    results = {f"{op}/{b}": [] for op in ("shuffle", "unpermute") for b in backends}
    for b in backends:  # warm-up and a correctness check
        assert all(torch.equal(p, q) for p, q in zip(S.shuffle(mask, u, z, x0, pos, backend=b),
                                                    S.shuffle(mask, u, z, x0, pos, backend="torch")))
        S.unpermute(x, sort_idx, backend=b)
    for _ in range(repeats):
        for b in backends:
            results[f"shuffle/{b}"].append(_time(lambda b=b: S.shuffle(mask, u, z, x0, pos, backend=b), sync))
            results[f"unpermute/{b}"].append(_time(lambda b=b: S.unpermute(x, sort_idx, backend=b), sync))
    return {k: statistics.median(v) for k, v in results.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    if S.HAVE_CPP:
        runs.append(("cpu", "cpp"))
    else:
        print("megatron_dllm._esolm_shuffle is not built: timing the torch reference alone")
    if torch.cuda.is_available() and S.HAVE_CUDA:
        runs.append(("cuda", "cuda"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, median of {args.repeats}")
    print("| device | B | L | op | torch (ms) | native (ms) | torch / native |")
    print("|---|---|---|---|---|---|---|")
    for device, native in runs or [("cpu", None)]:
        for B in args.batch:
            backends = ["torch"] + ([native] if native else [])
            med = bench(B, args.length, args.repeats, device, backends)
            for op in ("shuffle", "unpermute"):
                t = med[f"{op}/torch"] * 1e3
                n = med[f"{op}/{native}"] * 1e3 if native else float("nan")
                print(f"| {device} ({native or 'torch'}) | {B} | {args.length} | {op} | "
                      f"{t:.3f} | {n:.3f} | {t / n:.2f}x |")


if __name__ == "__main__":
    main()
