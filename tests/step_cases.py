"""Shared by tests/test_cuda_graph.py, tests/test_gradient_accumulation_fusion.py and their
two-rank workers: a small training run built from pretrain_dllm.py's flags through
training/build.py, stepped by training/step.py on fresh micro-batches, and a CPU stand-in for the
CUDA graph that re-runs what it captured."""
import contextlib

import torch

from megatron_dllm import platform
from megatron_dllm.config import parse_args, resolve_defaults
from megatron_dllm.families import Noise, get_family
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.training import observability, step
from megatron_dllm.training.build import build_training_model

VOCAB = 100
OPTIONS = {"bd3lm": {"block_size": 4}}
GRAPH = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]


class RerunGraph:
    """A CPU stand-in for cuda_graph.CudaGraph. A capture runs nothing, so `capture` runs fn for its
    outputs and then puts the gradient buffers back as they were; `replay` runs fn again and writes
    its outputs into the captured ones, as a replay rewrites them. `mode`: a dispatch mode to
    capture under."""

    def __init__(self, model, mode=None):
        self.model, self.mode, self.fn, self.outputs = model, mode, None, None

    def capture(self, fn):
        grads = [p.main_grad.clone() for p in self.model[0].parameters()]
        with self.mode or contextlib.nullcontext():
            self.outputs = fn()
        for p, g in zip(self.model[0].parameters(), grads):
            p.main_grad.copy_(g)
        self.fn = fn
        return self.outputs

    def replay(self):
        for old, new in zip(self.outputs, self.fn()):
            for name, value in new.items():
                old[name].copy_(value)

    def release(self):
        self.fn = self.outputs = None


class Batches:
    """Two micro-batches of 2 per iteration, drawn anew from the iteration's first sample (plus
    `first`: another data-parallel rank's samples); with `mask_until`, iterations before that
    carry an explicit attention mask that masks nothing; `lengths`: {iteration: sequence length}
    for iterations shorter than `seq` (as --variable-seq-length-prob draws them)."""

    def __init__(self, family, seq: int, mask_until: int = 0, first: int = 0, lengths: dict | None = None):
        self.family, self.seq, self.mask_until, self.first = family, seq, mask_until, first
        self.lengths = lengths or {}
        self.mbs, self.num_microbatches = 2, 2

    def iteration(self, consumed: int, number: int | None = None):
        seq = self.lengths.get(number, self.seq)
        for m in range(self.num_microbatches):
            start = self.first + consumed + m * self.mbs
            gen = torch.Generator().manual_seed(start)
            tokens = torch.randint(0, VOCAB - 1, (self.mbs, seq + int(self.family.extra_token)), generator=gen)
            ids = torch.arange(start, start + self.mbs)
            inp = self.family.corrupt(tokens, Noise(0, ids, strata=ids - consumed, num_strata=4))
            if number is not None and number < self.mask_until:
                inp.attention_mask = torch.zeros(1, 1, seq, seq, dtype=torch.bool)
            yield inp.map(platform.to_device)


def build(family_name: str, *flags: str):
    options = OPTIONS.get(family_name, {})
    family = get_family(family_name, VOCAB - 1, VOCAB, **options)
    argv = ["--family", family_name, "--preset", "cpu-micro", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "10", "--lr", "0.01", "--lr-warmup-iters", "0", "--seed", "0",
            "--attention-backend", "sdpa", *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()], *flags]
    config = resolve_defaults(parse_args(argv))
    return config, family, build_training_model(config, family, VOCAB, observability.make_timers(1))


def train(family_name: str, iterations: int, *flags: str, mask_until: int = 0, stand_in: bool = True,
          first: int = 0, lengths: dict | None = None):
    """(losses, gradient norms, final weights, the built model) of `iterations` steps on the
    Batches from sample `first` (`mask_until`, `lengths`: see Batches); with GRAPH flags the graph
    is a RerunGraph (`stand_in`) or a CUDA graph."""
    config, family, built = build(family_name, *flags)
    with torch.no_grad():  # live adaLN gates and head: gradients reach every layer (zero-initialised, only the head's)
        initialize_weights(built.model[0].module, seed=7, adaln_zero=False)
    built.optimizer.reload_model_params()  # bf16: the optimizer's fp32 copies too
    if built.graph is not None and stand_in:
        built.graph.graph_type = lambda: RerunGraph(built.model)
    batches = Batches(family, config.model.seq_length, mask_until, first, lengths)
    steps = [step.train_step(built.model, built.optimizer, built.scheduler, family, batches, 4 * i, config,
                             built.transformer_config.timers, iteration=i + 1, graph=built.graph)
             for i in range(iterations)]
    losses, norms = zip(*steps)
    return list(losses), list(norms), [p.detach().clone() for p in built.model[0].parameters()], built
