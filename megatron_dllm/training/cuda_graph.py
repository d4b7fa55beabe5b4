"""Megatron-LM's full-iteration CUDA graph (`--cuda-graph-impl local --cuda-graph-scope
full_iteration`): the forward and backward of all of an iteration's micro-batches, captured once
and then replayed, so the host launches one graph per iteration instead of every kernel.

Why: on one H100 the 1.7B step leaves the GPU idle for a fifth of its time while the host
dispatches about 240 ms of operations per micro-batch (benchmarks/RESULTS.md, "Where the 1.7B
step's time goes"). A replay costs the host microseconds.

How an iteration runs (`FullIterationGraph.__call__`):
- the first `--cuda-graph-warmup-steps` iterations run eagerly (the compiled regions compile, the
  libraries pick their kernels and workspaces);
- the next one copies its micro-batches into buffers of its own, captures megatron-core's schedule
  over them and replays the capture (a capture records kernels without running them);
- every later one copies its micro-batches into those buffers and replays. Micro-batches of
  another form (an annealed attention mask that becomes None, an SFT batch or a
  `--variable-seq-length-prob` draw of another length) drop the graph and give its memory back:
  eager warm-up iterations again, the first of them the new form's, then a new capture. At the
  paper's 1.7B setting (probability 0.01 per micro-batch) that is about 3 eager iterations in 50.

What stays outside the graph: megatron-core's `finalize_model_grads` (the data-parallel gradient
reduction and the per-token loss scaling, which compares the token count on the host, a
synchronisation that a capture refuses) runs eagerly after each replay on the token count the
graph leaves, and megatron-core's timers (whose events or synchronisations a capture must not
hold) are off inside the capture: the 'forward-backward' timer times the replay and the
finalisation instead. The optimizer step, the loss read-out and the gradient norm are the train
step's own, after this.

Why not megatron-core's `FullCudaGraphWrapper`: it keeps its graph and buffers in class
attributes (one model per process), takes dict batches, and captures `finalize_model_grads` with
its host-side comparison. The flags' limits (one device's forward and backward at fixed shapes)
are checked by config/validate.py (`cuda_graph`).
"""
from __future__ import annotations

import torch

from megatron_dllm.families.base import ModelInput


class CudaGraph:
    """One CUDA graph: `capture(fn)` records fn's kernels without running them and returns its
    outputs, which every `replay()` recomputes in place."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn):
        torch.cuda.synchronize()
        # The capture allocates from a memory pool of its own and cannot free cached blocks while it
        # runs: the warm-up's free cached memory goes back to the driver first.
        torch.cuda.empty_cache()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # other threads may use CUDA
            return fn()

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        """Give the capture's memory pool back, for the eager iterations before the next capture
        (the graph and what it allocated hold a whole iteration's activations)."""
        self.graph.reset()
        torch.cuda.empty_cache()


def _form(batch: ModelInput) -> tuple:
    """What a capture is specialised to: each field's shape and dtype (None for an absent one)."""
    return tuple(None if v is None else (tuple(v.shape), v.dtype) for v in batch.__dict__.values())


class FullIterationGraph:
    """Runs an iteration's `forward_backward(data_iterator=...) -> losses` eagerly for the warm-up
    iterations, then as a captured graph; `model_config` is the TransformerConfig whose
    `finalize_model_grads_func` and `timers` megatron-core's schedule reads."""

    def __init__(self, model_config, warmup_steps: int, graph_type=CudaGraph):
        self.config, self.warmup_steps, self.graph_type = model_config, warmup_steps, graph_type
        self.eager_left = warmup_steps
        self.graph = self.inputs = self.losses = self.finalize_call = None
        self.captures = 0  # graphs captured so far (a change of form captures anew)

    def __call__(self, forward_backward, micro_batches) -> list:
        batches = list(micro_batches)
        if self.graph is not None and [_form(b) for b in batches] != [_form(b) for b in self.inputs]:
            self.losses = self.inputs = self.finalize_call = None  # these hold tensors of its memory pool
            self.graph.release()
            self.graph, self.eager_left = None, self.warmup_steps
        if self.eager_left > 0:
            self.eager_left -= 1
            return forward_backward(data_iterator=iter(batches))
        if self.graph is None:
            self.inputs = [b.map(torch.clone) for b in batches]
            self.graph = self.graph_type()
            self.losses = self.graph.capture(lambda: self._deferred(forward_backward))
            self.captures += 1
        else:
            for static, batch in zip(self.inputs, batches):
                for name, value in batch.__dict__.items():
                    if value is not None:
                        getattr(static, name).copy_(value)
        timers = self.config.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start()
        self.graph.replay()
        finalize, args, kwargs = self.finalize_call
        finalize(*args, **kwargs)
        if timers is not None:
            timers("forward-backward").stop()
        return self.losses

    def _deferred(self, forward_backward) -> list:
        """The schedule over the static micro-batches with its finalisation recorded, not run,
        and megatron-core's timers off: what the graph holds."""
        config = self.config
        finalize, timers = config.finalize_model_grads_func, config.timers

        def record(*args, **kwargs):
            self.finalize_call = (finalize, args, kwargs)

        config.finalize_model_grads_func, config.timers = record, None
        try:
            return forward_backward(data_iterator=iter(self.inputs))
        finally:
            config.finalize_model_grads_func, config.timers = finalize, timers
