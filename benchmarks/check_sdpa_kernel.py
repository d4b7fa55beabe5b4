"""Which kernel `--attention-backend sdpa` runs for a head shape: forward and backward of
`scaled_dot_product_attention` under the platform's kernel priority (`platform.sdpa_backends()`:
cuDNN's fused attention first on Hopper), profiled, with the SDPA backend each pass chose.

    python benchmarks/check_sdpa_kernel.py [--heads 17] [--head-dim 128] [--seq 2048] [--batch 1]

Defaults: the 1.7B preset's heads (17 of 128) at seq 2048, causal and bidirectional, in bf16 on a
GPU (fp32 on a CPU, where the same check names the CPU's kernel). Prints the profiler's top
device kernels and one line per mask: the backend of the forward and of the backward pass, read
from the `aten::_scaled_dot_product_*` operator that ran. On an H100 the expected answer is
`cudnn` for both.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

from megatron_dllm import platform  # noqa: E402

# aten operator (forward; the backward's name adds `_backward`) -> backend
BACKENDS = {"_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_flash_attention": "flash",
            "_scaled_dot_product_efficient_attention": "efficient",
            "_scaled_dot_product_flash_attention_for_cpu": "cpu-flash", "_scaled_dot_product_attention_math": "math"}


def chosen(events, backward: bool) -> str:
    """The backend whose operator appears among the profiled `events` for that pass."""
    suffix = "_backward" if backward else ""
    names = {e.key for e in events}
    found = [b for op, b in BACKENDS.items() if f"aten::{op}{suffix}" in names]
    if backward and not found and "aten::_scaled_dot_product_attention_math" in names:
        found = ["math"]  # the math path's backward is autograd through its parts
    return ", ".join(found) or "none recognised"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=17)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    device = platform.device()
    dtype = torch.bfloat16 if platform.HAS_CUDA else torch.float32
    print(f"{platform.device_name() or 'CPU'}, torch {torch.__version__}, {dtype}, batch {args.batch} x "
          f"{args.heads} heads x seq {args.seq} x {args.head_dim}; kernel priority "
          f"{[b.name for b in platform.sdpa_backends()]}")
    for causal in (True, False):
        q, k, v = (torch.randn(args.batch, args.heads, args.seq, args.head_dim, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        with sdpa_kernel(platform.sdpa_backends(), set_priority=True):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()  # warm-up (cuDNN plans)
            platform.synchronize()
            with torch.profiler.profile(activities=platform.profiler_activities()) as prof:
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
                platform.synchronize()
        events = prof.key_averages()
        sort = "self_device_time_total" if platform.HAS_CUDA else "self_cpu_time_total"
        print(f"\n{'causal' if causal else 'bidirectional'}:\n{events.table(sort_by=sort, row_limit=8)}")
        print(f"{'causal' if causal else 'bidirectional'}: forward {chosen(events, False)}, "
              f"backward {chosen(events, True)}", flush=True)


if __name__ == "__main__":
    main()
