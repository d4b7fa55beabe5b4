"""`--recompute-modules mlp_act` (`layer.ActivationRecomputingMLP`): for every MLP built here (the
DiT's tanh-GELU, fused or not; the GPT backbone's GELU and SwiGLU, fused or not, with and without
biases) the output and every gradient equal megatron-core's own `MLP.forward` bit for bit, and the
forward keeps at least the activation's output less for the backward."""
import dataclasses

import pytest
import torch
from attention_cases import BATCH, LLAMA, PRESET, SEQ, build

from megatron_dllm import platform
from megatron_dllm.model.fusion import Fusion

GPT_GELU = dataclasses.replace(LLAMA, swiglu=False, add_bias_linear=True)
MLPS = {  # name: (the GPT backbone's shape, None for the DiT; the fusions)
    "dit": (None, Fusion()),
    "dit-fused-bias-gelu": (None, Fusion(bias_gelu=True)),
    "gpt-gelu": (GPT_GELU, Fusion()),
    "gpt-swiglu": (LLAMA, Fusion()),
    "gpt-fused-swiglu": (LLAMA, Fusion(bias_swiglu=True)),
}
ACT = {"recompute_granularity": "selective", "recompute_modules": ["mlp_act"]}


@pytest.fixture(scope="module", autouse=True)
def distributed():
    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


def mlp_step(gpt, fusion: Fusion, recompute: dict | None):
    """(output, the gradients of the input and of every parameter, elements the forward saved) of
    the first layer's MLP, on the same weights and input whatever `recompute` says."""
    model = build("bidirectional", "sdpa", recompute=recompute, fusion=fusion, gpt=gpt)
    mlp = (model.layers if gpt is None else model.decoder.layers)[0].mlp
    mlp.train()
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(SEQ, BATCH, PRESET.hidden_size, generator=gen).to(platform.device()).requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_autograd_node() is None and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage()._cdata] = t.untyped_storage()  # alive while autograd keeps it
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, bias = mlp(h)
        out = out if bias is None else out + bias
        saved = sum(s.nbytes() for s in storages.values()) // h.element_size()  # discarded outputs: 0
        (out * torch.randn(out.shape, generator=gen).to(out.device)).sum().backward()
    return out.detach(), {"input": h.grad, **{n: p.grad for n, p in mlp.named_parameters()}}, saved


@pytest.mark.parametrize("name", MLPS)
def test_recomputed_activation_equals_megatron_s_mlp(name):
    gpt, fusion = MLPS[name]
    want_out, want_grads, want_saved = mlp_step(gpt, fusion, None)
    got_out, got_grads, got_saved = mlp_step(gpt, fusion, ACT)
    assert torch.equal(got_out, want_out)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads), name
    ffn = PRESET.hidden_size * 4 if gpt is None else gpt.ffn_hidden_size
    assert want_saved - got_saved >= SEQ * BATCH * ffn  # the activation's output, at least
