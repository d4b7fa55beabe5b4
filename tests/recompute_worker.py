"""One process: the DiT's loss and every gradient under each recompute setting, against no
recompute (which parameters' gradients are bit-identical, and the largest relative difference
of any), plus how often each layer, core attention, MLP, MLP activation and modulated norm ran
(proof that recompute happened).
Prints one JSON object."""
import dataclasses
import json

import torch

from megatron_dllm import platform
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.model.presets import get_preset

SETTINGS = {
    "none": None,
    "selective": {"recompute_granularity": "selective"},
    "selective-layernorm": {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
    "selective-mlp": {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
    "selective-mlp_act": {"recompute_granularity": "selective", "recompute_modules": ["mlp_act"]},
    "selective-all": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm", "mlp"]},
    "selective-all-act": {"recompute_granularity": "selective",
                          "recompute_modules": ["core_attn", "layernorm", "mlp_act"]},
    "full-uniform-1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full-uniform-2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full-block-1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


def run(arch, recompute):
    config, mlp_config = transformer_config(arch, recompute=recompute)
    model = build_model(arch, config, mlp_config, seed=7)[0]
    initialize_weights(model, seed=7, adaln_zero=False)
    model.train()
    calls = {}

    def count(key):
        calls[key] = calls.get(key, 0) + 1

    for i, layer in enumerate(model.layers):
        for name, module in (("layer", layer), ("core_attention", layer.self_attention.core_attention),
                             ("mlp", layer.mlp)):
            module.register_forward_hook(lambda *_, key=f"{name}{i}": count(key))
        real = layer.mlp.activation  # called by the MLP only where it recomputes the activation
        layer.mlp.activation = lambda *a, real=real, key=f"activation{i}": count(key) or real(*a)
        for name, norm in (("input_norm", layer.input_layernorm), ("pre_mlp_norm", layer.pre_mlp_layernorm)):
            for method in ("modulated", "after_residual"):  # the layer calls one or the other
                real = getattr(norm, method)
                setattr(norm, method, lambda *a, real=real, key=f"{name}{i}", **k: count(key) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, arch.seq_length), generator=g)
    positions = torch.arange(arch.seq_length).expand(2, -1)
    sigma = torch.rand(2, generator=g)
    logits = model(ids, positions, sigma)
    weights = torch.randn(logits.shape, generator=g)
    loss = (logits.float() * weights).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls


def main():
    platform.init_distributed(1, 1)
    preset = dataclasses.replace(get_preset("cpu-tiny"), num_layers=4)
    arch = Architecture(preset, 300, 16, "bidirectional")
    reference_loss, reference_grads, _ = run(arch, None)
    out = {}
    for name, recompute in SETTINGS.items():
        loss, grads, calls = run(arch, recompute)
        out[name] = {"loss_equal": loss == reference_loss,
                     "grads_equal": [k for k in reference_grads if torch.equal(grads[k], reference_grads[k])],
                     "grads_max_rel_diff": max(((grads[k] - reference_grads[k]).abs().max()
                                                / reference_grads[k].abs().max().clamp_min(1e-30)).item()
                                               for k in reference_grads),
                     "calls": calls}
    print(json.dumps(out))
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
