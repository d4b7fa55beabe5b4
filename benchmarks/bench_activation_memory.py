"""Activation memory per layer: what the trainer's step keeps from its forward for its backward.

    python benchmarks/bench_activation_memory.py [--backbone dit gpt] [--fusion none all]
                                                 [--attention-backend sdpa local]
                                                 [--recompute off selective layernorm mlp_act
                                                             layernorm+mlp_act mlp layernorm+mlp full]

For every combination: the trainer's step (`bench_train_step.MegatronStep`, MDLM, fp32 on CPU)
at 1 and at 2 layers, of the DiT or of the GPT backbone as a Llama (RMSNorm, SwiGLU of width 4h,
rotary, no biases: SmolLM2-1.7B's proportions; `layernorm` recompute needs TransformerEngine
there). Every tensor autograd saves during the forward (not during the backward's recomputation)
is recorded by its storage, parameters left out; the storages' sizes are summed
when the backward starts, after megatron-core's output-discarding checkpoints have released
theirs. Beside it, as a check, how much the C allocator's bytes in use (glibc's) grew from the
forward's first save to the backward's start: that counts what the forward left unsaved too, and
glibc's bookkeeping makes it noisy. The difference between the two depths is one layer's, in units of
s x b x h elements (sequence, micro-batch, hidden size). The ratio carries over to other sizes
(the MLP is 4h wide in every preset) but for two terms: megatron-core's eager rotary embedding
saves its cos and sin for the queries and the keys, 4 x head size / h (1 here, 0.24 at the 1.7B
preset; the compiled rotary keeps one table for all layers), and `--attention-backend local`
keeps the [b, heads, s, s] scores, which grow with s. The last column turns the ratio into GiB
per sequence of a micro-batch at 2 bytes an element (bf16), seq 2048, at the DiT's 1.7B preset
(28 layers, h 2176) or at SmolLM2-1.7B's shape for the GPT backbone (24 layers, h 2048).

Counting needs no GPU; which tensors a GPU's kernels save can differ (SDPA's backends save the
same inputs, output and log-sum-exp; TorchInductor's partition of the compiled regions is made
the same way).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_train_step import MegatronStep, make_batch, recompute_setting  # noqa: E402

from megatron_dllm import platform  # noqa: E402
from megatron_dllm.families import get_family  # noqa: E402
from megatron_dllm.model.presets import Preset, get_preset  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN, HEADS = 1025, 64, 2, 128, 4
GPT = ("--backbone", "gpt", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--disable-bias-linear", "--ffn-hidden-size", str(4 * HIDDEN))
REFERENCE = {"dit": "1.7B", "gpt": "smollm2-1.7b"}  # the preset of the last column


class SavedInForward:
    """The storages autograd saves outside the backward; `bytes` is their size when the backward
    first reads one of them, `allocated` what the allocator's bytes in use grew by from the first
    save to then (everything the forward left, saved or not)."""

    def __init__(self, parameters):
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages, self.bytes, self.allocated = {}, None, platform.allocated_bytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if torch._C._current_autograd_node() is None and storage.data_ptr() not in self.skip:
            # keyed by the storage itself, not its address: a checkpoint's discarded output frees its
            # memory during the forward, and a later tensor may get the address
            self.storages.setdefault(storage._cdata, storage)
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self.bytes is None:
            self.bytes = sum(s.nbytes() for s in self.storages.values())
            self.allocated = platform.allocated_bytes() - self.allocated
            self.storages = {}
        return t


def saved_elements(layers: int, fusion: str, backend: str, recompute: str | None,
                   backbone: str = "dit") -> tuple[float, float]:
    """(elements saved, elements' worth the allocator's bytes in use grew by) in one step's forward
    of a model of `layers` layers."""
    family = get_family("mdlm", VOCAB - 1, VOCAB)
    step = MegatronStep(Preset(HIDDEN, layers, HEADS), VOCAB, BATCH, SEQ, family, make_batch(family, VOCAB, BATCH, SEQ),
                        train_iters=10, keep_initial=False, attention_backend=backend, recompute=recompute,
                        fusion=fusion, extra_flags=GPT if backbone == "gpt" else ())
    step()  # compiles the regions, if any, and makes the optimizer's state
    saved = SavedInForward(step.model[0].parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step()
    return saved.bytes / 4, saved.allocated / 4  # fp32 on CPU


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", nargs="+", choices=list(REFERENCE), default=["dit"])
    ap.add_argument("--fusion", nargs="+", choices=["none", "all"], default=["none", "all"])
    ap.add_argument("--attention-backend", nargs="+", choices=["sdpa", "local"], default=["sdpa"])
    ap.add_argument("--recompute", nargs="+", type=recompute_setting,
                    default=["off", "selective", "layernorm", "mlp_act", "layernorm+mlp_act", "mlp",
                             "layernorm+mlp", "full"],
                    help="off | full | selective (core attention) | modules recomputed selectively, joined by '+'")
    args = ap.parse_args(argv)
    platform.init_distributed(1, 1, seed=0)
    print(f"torch {torch.__version__}; MDLM, hidden {HIDDEN}, {HEADS} heads, seq {SEQ} x micro-batch {BATCH}, fp32")
    print("| backbone | fusion | attention | recompute | saved per layer (s*b*h elements) | allocator's growth per "
          "layer (s*b*h elements) | GiB per sequence (1.7B DiT or SmolLM2-1.7B) |")
    print("|---|---|---|---|---:|---:|---:|")
    for backbone, fusion, backend, recompute in itertools.product(args.backbone, args.fusion, args.attention_backend,
                                                                  args.recompute):
        big = get_preset(REFERENCE[backbone])
        per_sequence = big.num_layers * 2048 * big.hidden_size * 2 / 2**30  # GiB per s*b*h unit at one sequence
        chosen = None if recompute == "off" else recompute
        (saved_1, grown_1), (saved_2, grown_2) = (saved_elements(n, fusion, backend, chosen, backbone) for n in (1, 2))
        units, grown = (saved_2 - saved_1) / (SEQ * BATCH * HIDDEN), (grown_2 - grown_1) / (SEQ * BATCH * HIDDEN)
        print(f"| {backbone} | {fusion} | {backend} | {recompute} | {units:.2f} | {grown:.2f} | "
              f"{units * per_sequence:.2f} |", flush=True)


if __name__ == "__main__":
    main()
