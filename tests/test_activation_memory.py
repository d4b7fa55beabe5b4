"""What a training forward keeps for the backward: every token-sized tensor autograd saves owns
its storage, so no view keeps a larger output alive (megatron-core splits the values out of the
fused QKV projection's output as a view; saved as they are, they kept all three of its parts);
`--recompute-modules layernorm` and `mlp` keep less by at least what they recompute
(benchmarks/bench_activation_memory.py's count of the trainer's step)."""
import pytest
import torch
from attention_cases import BATCH, FAMILIES, MASK_ID, OPTIONS, PRESET, SEQ, VOCAB, batch, build
from conftest import load_benchmark

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.model.fusion import Fusion

ONE_HEAD = SEQ * BATCH * PRESET.hidden_size // PRESET.num_attention_heads  # smaller: per-sequence tensors


@pytest.fixture(scope="module", autouse=True)
def distributed():
    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


def oversized_saves(name: str, backend: str, fusion: Fusion | None = None) -> list:
    """(shape, elements of its storage) of each activation the forward saved as a view into a larger
    storage; parameters left out."""
    family = get_family(name, MASK_ID, VOCAB, **OPTIONS.get(name, {}))
    inp = batch(family)
    model = build(family.attention, backend, fusion=fusion)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage, size = t.untyped_storage(), t.numel() * t.element_size()
        if storage.data_ptr() not in params and t.numel() >= ONE_HEAD and storage.nbytes() > size:
            found.append((tuple(t.shape), storage.nbytes() // t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inp.input_ids, inp.position_ids, inp.sigma, inp.attention_mask)
    return found


@pytest.mark.parametrize("backend", ["sdpa", "local"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_saved_activation_keeps_a_larger_storage_alive(family, backend):
    assert oversized_saves(family, backend) == []


@pytest.mark.slow  # compiles the elementwise regions
def test_nor_with_the_compiled_regions():
    assert oversized_saves("mdlm", "sdpa", Fusion(compile_elementwise=True)) == []


bench = load_benchmark("bench_activation_memory")


def saved_per_layer(recompute: str | None) -> float:
    """One layer's saved activations in the trainer's step (eager, SDPA), in units of s x b x h."""
    one, two = (bench.saved_elements(n, "none", "sdpa", recompute)[0] for n in (1, 2))
    return (two - one) / (bench.SEQ * bench.BATCH * bench.HIDDEN)


@pytest.mark.slow  # eight small models' training steps
def test_selective_recompute_modules_release_what_they_recompute():
    off, norms, mlp, both = (saved_per_layer(r) for r in (None, "layernorm", "mlp", "layernorm+mlp"))
    assert norms <= off - 2  # the two modulated norms' outputs [s, b, h], which the next linears saved
    assert mlp <= off - 8  # the MLP's pre-activation and activation, [s, b, 4h] each
    assert both <= off - 10
