"""CUDA graphs for the samplers' denoiser forwards (`SamplingConfig(cuda_graphs=True)`, `--cuda-graphs`).

At batch 1 a forward of the dense model dispatches about sixty operations per layer (counted on
CPU: about 1,700 at the 1.7B shape's 28 layers), and launching their kernels one by one from
Python takes longer than reading the weights (1.1 ms for 3.4 GB of bf16 at an H100's 3 TB/s); a
CUDA graph launches the whole forward at once. A forward is captured the second time its inputs'
shapes are met (a shape met once, such as a prompt's prefill, stays eager) and replayed from then
on: the inputs are copied into the graph's own buffers, and the logits come back in its output
buffer, valid until the next call (every sampler uses them before it calls again).

Only forwards whose every input can live in such a buffer are captured: token ids, positions, the
time input, the flat positions whose logits the sampler draws from (`logits_at`, so that the
output layer, the largest matmul at a 131k vocabulary, runs only there) and a fixed-shape KV cache
(`KVCache(fixed_shape=True)`: its length is a device tensor) with its `kv_keep`. Any other
forward (an attention mask, another kind of cache) runs eagerly: its host code reads values (a
padding mask's all-true check, a Python cache length) that a replay would not read again.

Host synchronisation in the loops: no sampler's `sample` waits for the GPU between its forwards
(the batched `sample_batch` runs eagerly and reads each row's canvas width). EOS
stopping reads a copy of whether every row is done that the GPU writes without a wait
(`base.EosStop`); MDLM reads when its positions unmask once, before its loop (`mdlm.UnmaskingPlan`).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .deps import InputError

CAPTURED_INPUTS = ("input_ids", "position_ids", "sigma", "timesteps")


class CUDAGraphModel:
    def __init__(self, model: torch.nn.Module):
        self.device = next(model.parameters()).device
        self.model, self.config = model, model.config
        self.graphs: dict = {}  # inputs' (name, shape, dtype) -> (graph, input buffers, logits buffer)
        self.seen: set = set()  # keys met once, not captured yet
        self.cache = None  # the KV cache the graphs write into: another one drops them
        self.pool = None  # one memory pool for all graphs (they never run at the same time)
        self.ints: dict[int, torch.Tensor] = {}  # kv_keep values on the device

    def __call__(self, kv_cache=None, kv_keep=None, logits_at=None, **inputs):
        """The forward, replayed from a graph where it can be. Its output layer runs only at the flat
        positions `logits_at` (padded to a power of two, so that steps whose counts differ share a
        few graphs); a slice picks from the logits of every position the graph computes."""
        given = {name for name, value in inputs.items() if value is not None}
        fixed = kv_cache is None or getattr(kv_cache, "fixed_shape", False)
        if not fixed or not given <= set(CAPTURED_INPUTS):
            return self.model(kv_cache=kv_cache, kv_keep=kv_keep, logits_at=logits_at, **inputs)
        if isinstance(logits_at, torch.Tensor):  # an input of the graph, which runs the output layer only there
            n = len(logits_at)
            out = self.run(kv_cache, kv_keep, logits_at=power_of_two_rows(logits_at), **inputs)
            return SimpleNamespace(logits=out.logits[:n])
        out = self.run(kv_cache, kv_keep, **inputs)
        return out if logits_at is None else SimpleNamespace(logits=out.logits[:, logits_at])

    def run(self, kv_cache, kv_keep, **inputs):
        if kv_cache is not self.cache:  # a new sample's cache: the graphs of the last one go, and their memory
            self.graphs, self.seen, self.cache, self.pool = {}, set(), kv_cache, None
        tensors = {name: torch.as_tensor(value, device=self.device) for name, value in sorted(inputs.items())
                   if value is not None}
        if kv_keep is not None:
            tensors["kv_keep"] = self.device_int(kv_keep) if isinstance(kv_keep, int) else kv_keep
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return SimpleNamespace(logits=self.forward(tensors))
            self.graphs[key] = self.capture(tensors)
        graph, buffers, logits = self.graphs[key]
        for name, tensor in tensors.items():
            buffers[name].copy_(tensor)
        graph.replay()
        return SimpleNamespace(logits=logits)

    def device_int(self, value: int) -> torch.Tensor:
        """`value` as a long scalar on the device, made once: copying a Python int to the device at
        every step would wait for the GPU each time."""
        if value not in self.ints:
            self.ints[value] = torch.tensor(value, dtype=torch.long, device=self.device)
        return self.ints[value]

    def forward(self, tensors: dict) -> torch.Tensor:
        inputs = dict(tensors)
        keep = inputs.pop("kv_keep", None)
        return self.model(kv_cache=self.cache, kv_keep=keep, **inputs).logits

    def capture(self, tensors: dict):
        """Capture one forward of `tensors`' shapes into a new graph, after a warm-up run on a side
        stream (PyTorch's recipe); the warm-up advances the cache, so its length is put back."""
        buffers = {name: tensor.clone() for name, tensor in tensors.items()}
        filled = None if self.cache is None else self.cache.filled.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(buffers)
        torch.cuda.current_stream().wait_stream(stream)
        if filled is not None:
            self.cache.filled.copy_(filled)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(buffers)
        self.pool = graph.pool()
        return graph, buffers, logits


def power_of_two_rows(positions: torch.Tensor) -> torch.Tensor:
    """`positions` padded with position 0 to a power-of-two count (at least 1): the padding rows'
    logits are computed and dropped."""
    n = len(positions)
    return F.pad(positions, (0, (1 << (max(n, 1) - 1).bit_length()) - n))


def graphed(model: torch.nn.Module) -> CUDAGraphModel:
    """`model` behind CUDA graphs (`--cuda-graphs`), which need it on a CUDA device: the graphs of
    this call (freed with it), or inside `shared_graphs(model)` those of every call there."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise InputError(f"--cuda-graphs: CUDA graphs need the model on a CUDA device; it is on {device.type}")
    return getattr(model, "_shared_cuda_graphs", None) or CUDAGraphModel(model)


@contextlib.contextmanager
def shared_graphs(model: torch.nn.Module):
    """Inside: every generate call on `model` replays the graphs the earlier ones captured (a
    benchmark's timed calls after its warm-up, at one batch size); after: they are freed."""
    model._shared_cuda_graphs = CUDAGraphModel(model)
    try:
        yield
    finally:
        del model._shared_cuda_graphs
