"""What a training forward keeps for the backward: no token-sized storage is kept for a part of
it, that is, the tensors autograd saves from one storage add up to all of it (megatron-core
splits the values out of the fused QKV projection's output as a view; saved as they were, they
kept all of it, rotated queries and keys being new tensors), on the DiT and the GPT backbone;
`--recompute-modules layernorm`, `mlp` and `mlp_act` keep less by at least what they recompute
(benchmarks/bench_activation_memory.py's count of the trainer's step)."""
import collections
import dataclasses
import math

import pytest
import torch
from attention_cases import BATCH, FAMILIES, LLAMA, MASK_ID, OPTIONS, PRESET, SEQ, VOCAB, batch, build
from conftest import load_benchmark

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.model.fusion import Fusion

ONE_HEAD = SEQ * BATCH * PRESET.hidden_size // PRESET.num_attention_heads  # smaller: per-sequence tensors
# The GPT backbone (Llama's shape: rotary embedding, grouped queries) with a GELU MLP: megatron-core's
# unfused SwiGLU keeps its input for the gate's half (and copies the other); its fused one
# (--bias-swiglu-fusion) does not, tested below.
GPT = dataclasses.replace(LLAMA, swiglu=False)


@pytest.fixture(scope="module", autouse=True)
def distributed():
    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


def partly_saved_storages(name: str, backend: str, fusion: Fusion | None = None, gpt=None) -> list:
    """(elements saved, elements of the storage) of each token-sized storage the forward saved
    less than all of (views whose elements do not add up to it), parameters left out."""
    family = get_family(name, MASK_ID, VOCAB, **OPTIONS.get(name, {}))
    inp = batch(family)
    model = build(family.attention, backend, fusion=fusion, gpt=gpt)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    views = collections.defaultdict(set)  # storage -> (offset, shape, strides) of its saved tensors
    sizes = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() >= ONE_HEAD * t.element_size():
            views[storage.data_ptr()].add((t.storage_offset(), tuple(t.shape), t.stride()))
            sizes[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inp.input_ids, inp.position_ids, inp.sigma, inp.attention_mask)
    saved = {ptr: sum(math.prod(shape) for _, shape, _ in found) for ptr, found in views.items()}
    return [(saved[ptr], sizes[ptr]) for ptr in views if saved[ptr] < sizes[ptr]]


@pytest.mark.parametrize("backend", ["sdpa", "local"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_storage_is_kept_for_part_of_it(family, backend):
    assert partly_saved_storages(family, backend) == []


@pytest.mark.parametrize("family", ["ar", "mdlm"])
def test_nor_on_the_gpt_backbone(family):
    assert partly_saved_storages(family, "sdpa", gpt=GPT) == []


@pytest.mark.slow  # compiles the elementwise regions
def test_nor_with_the_compiled_regions():
    assert partly_saved_storages("mdlm", "sdpa", Fusion(compile_elementwise=True)) == []


@pytest.mark.slow  # megatron-core's fused SwiGLU compiles
def test_nor_with_the_gpt_backbone_s_fused_swiglu():
    assert partly_saved_storages("mdlm", "sdpa", Fusion(bias_swiglu=True), gpt=LLAMA) == []
    assert partly_saved_storages("mdlm", "sdpa", gpt=LLAMA) != []  # the unfused one keeps a half


bench = load_benchmark("bench_activation_memory")


def saved_per_layer(recompute: str | None, backbone: str = "dit") -> float:
    """One layer's saved activations in the trainer's step (eager, SDPA), in units of s x b x h."""
    one, two = (bench.saved_elements(n, "none", "sdpa", recompute, backbone)[0] for n in (1, 2))
    return (two - one) / (bench.SEQ * bench.BATCH * bench.HIDDEN)


@pytest.mark.slow  # twelve small models' training steps
def test_selective_recompute_modules_release_what_they_recompute():
    settings = (None, "layernorm", "mlp", "layernorm+mlp", "mlp_act", "layernorm+mlp_act")
    off, norms, mlp, both, act, norms_act = (saved_per_layer(r) for r in settings)
    assert norms <= off - 2  # the two modulated norms' outputs [s, b, h], which the next linears saved
    assert mlp <= off - 8  # the MLP's pre-activation and activation, [s, b, 4h] each
    assert both <= off - 10
    assert act <= off - 4  # the activation [s, b, 4h]; its input stays
    assert norms_act <= off - 6


@pytest.mark.slow  # four small models' training steps
def test_the_gpt_backbone_s_mlp_releases_its_unfused_swiglu_s_intermediates_too():
    off, act = saved_per_layer(None, "gpt"), saved_per_layer("mlp_act", "gpt")
    # SwiGLU of width f = 4h: the gate's activation, the copied half and the product (f each) go;
    # the first linear's output (2f) stays
    assert act <= off - 12
