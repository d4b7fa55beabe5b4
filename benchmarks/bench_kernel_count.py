"""Kernels per layer of one sampling forward: eager PyTorch against `InferenceModel.compile()`.

    python benchmarks/bench_kernel_count.py [--families ar mdlm] [--dtype bfloat16] [--hidden 64]

At batch 1 a forward's time is mostly the floor each kernel costs, not its arithmetic, so the
number of kernels per layer is what `--compile` changes. Eager: the ATen operations a forward
dispatches that are not views (each one kernel on a GPU). Compiled: the calls in TorchInductor's
generated code for the same forward (fused kernels, plus the matmuls and attention it leaves to
ATen). Counted at two depths (2 and 4 layers), so the difference over 2 is per layer; the shapes
other than the depth change neither count. The forward is AR's decoding step (one token, the
fixed-shape KV cache the samplers use with graphs) and MDLM's full-canvas forward. Counting needs
no GPU: Inductor's CPU code has the same fusion plan (its GPU kernels are Triton's).
"""
from __future__ import annotations

import argparse
import collections
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.hf.random_model import random_dense_model

LENGTH, PROMPT = 64, 16


class OpCounter(TorchDispatchMode):
    """The ATen operations dispatched, by operator, views left out (a view launches nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket] += not func.is_view
        return func(*args, **(kwargs or {}))


def forward_of(family: str, layers: int, hidden: int, dtype: torch.dtype):
    """(model, the kwargs of the forward counted), the cache already holding the prompt."""
    model = random_dense_model(family, 1000, LENGTH, hidden_size=hidden, num_layers=layers, num_heads=2).to(dtype)
    ids, positions = torch.randint(0, 999, (1, LENGTH)), torch.arange(LENGTH)[None]
    if family == "ar":
        cache = KVCache(layers, LENGTH, fixed_shape=True)
        model(input_ids=ids[:, :PROMPT], position_ids=positions[:, :PROMPT], kv_cache=cache)
        return model, {"input_ids": ids[:, PROMPT:PROMPT + 1], "position_ids": positions[:, PROMPT:PROMPT + 1],
                       "kv_cache": cache}
    return model, {"input_ids": ids, "position_ids": positions}


def eager_ops(family, layers, hidden, dtype) -> int:
    model, kwargs = forward_of(family, layers, hidden, dtype)
    with OpCounter() as counter:
        model(**kwargs)
    return sum(counter.ops.values())


def compiled_calls(family, layers, hidden, dtype) -> int:
    """Calls in the `call` function of Inductor's code for the forward: fused kernels, ATen's
    externs (matmuls, attention) and fallbacks."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, kwargs = forward_of(family, layers, hidden, dtype)
    _, codes = run_and_get_code(torch.compile(model, dynamic=False), **kwargs)
    body = "\n".join(code.split("def call(", 1)[1].split("\ndef ", 1)[0] for code in codes)
    return len(re.findall(r"\b(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", body))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=["ar", "mdlm"], default=["ar", "mdlm"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}; {args.dtype} weights; hidden {args.hidden}")
    print("| forward | eager ops per layer | compiled calls per layer | eager / compiled | whole forward at 2 layers "
          "(eager, compiled) |")
    print("|---|---:|---:|---:|---|")
    with torch.no_grad():
        for family in args.families:
            eager = [eager_ops(family, n, args.hidden, dtype) for n in (2, 4)]
            compiled = [compiled_calls(family, n, args.hidden, dtype) for n in (2, 4)]
            per_eager, per_compiled = (eager[1] - eager[0]) / 2, (compiled[1] - compiled[0]) / 2
            name = "AR decoding step" if family == "ar" else "MDLM full canvas"
            print(f"| {name} | {per_eager:g} | {per_compiled:g} | {per_eager / per_compiled:.1f} | "
                  f"{eager[0]}, {compiled[0]} |", flush=True)


if __name__ == "__main__":
    main()
