"""The megatron-core DiTModel against the dense DiT (megatron_dllm/hf/modeling_dllm.py), the plain
PyTorch DiT (as in the paper's code) that every HF export runs.

Single process on CPU (world size 1, TP=1, PP=1): the megatron model's weights are converted into
the dense model (`hf.export.hf_model`) and logits and gradients must agree in fp32, with
megatron-core's core attention (`local`) and with PyTorch's SDPA (`sdpa`).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_dllm import platform
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.families import get_family
from megatron_dllm.hf import export
from megatron_dllm.model.presets import Preset

VOCAB, PADDED, SEQ, BATCH = 300, 384, 32, 3  # PADDED: megatron's vocabulary, a multiple of 128
MASK_ID = VOCAB - 1
PRESET = Preset(64, 2, 4)
DEVICE = platform.device()  # where build_model puts the model


pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest


def build_megatron(attention: str, randomise: bool = True, attention_backend: str = "local"):
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config

    arch = Architecture(PRESET, VOCAB, SEQ, attention)
    config, mlp_config = transformer_config(arch)
    model = build_model(arch, config, mlp_config, seed=0, attention_backend=attention_backend)[0]
    if randomise:  # adaLN and output layer are zero-initialised: make the comparison non-trivial
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "adaLN_modulation" in name or "output_layer" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
                elif name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    ids[:, ::3] = MASK_ID
    positions = torch.stack([torch.randperm(SEQ, generator=gen) for _ in range(BATCH)])  # Eso-LM path
    sigma = torch.rand(BATCH, generator=gen) * 3.0
    return ids.to(DEVICE), positions.to(DEVICE), sigma.to(DEVICE)


def megatron_logits(model, ids, positions, sigma):
    return model(ids, positions, sigma).transpose(0, 1)  # [s, b, V] -> [b, s, V]


def dense(model, attention: str, vocab_size: int = PADDED):
    """The dense model holding the megatron model's weights (megatron's padded vocabulary kept)."""
    identity = ModelIdentity("ar" if attention == "causal" else "mdlm", PRESET.hidden_size, PRESET.num_layers,
                             PRESET.num_attention_heads, VOCAB, MASK_ID)
    return export.hf_model(model.state_dict(), identity, attention, SEQ, vocab_size).to(DEVICE)


def dense_logits(ref, ids, positions, sigma):
    return ref(input_ids=ids, position_ids=positions, sigma=sigma).logits


@pytest.mark.parametrize("backend", ["local", "sdpa"])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_logits_match_dense_model(attention, backend):
    model = build_megatron(attention, attention_backend=backend)
    ref = dense(model, attention)
    ids, positions, sigma = inputs()
    with torch.no_grad():
        got = megatron_logits(model, ids, positions, sigma)
        want = dense_logits(ref, ids, positions, sigma)
    assert got.shape == want.shape == (BATCH, SEQ, PADDED)  # padded vocabulary kept
    assert want.abs().max() > 1.0  # non-trivial
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Sliced to the real vocabulary (as exported): the same logits, without the padded rows.
    sliced = dense(model, attention, vocab_size=VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(sliced, ids, positions, sigma), got[..., :VOCAB],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_positions_matter(attention):
    """Permuted positions give different logits than identity positions (rotary is live), and
    permuting tokens together with their positions permutes the bidirectional output."""
    model = build_megatron(attention)
    ids, positions, sigma = inputs()
    identity = torch.arange(SEQ, device=DEVICE).expand(BATCH, SEQ)
    with torch.no_grad():
        a = megatron_logits(model, ids, positions, sigma)
        b = megatron_logits(model, ids, identity, sigma)
        assert (a - b).abs().max() > 1e-3
        if attention == "bidirectional":
            perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
            c = megatron_logits(model, ids[:, perm], positions[:, perm], sigma)
            torch.testing.assert_close(c, a[:, perm], atol=1e-5, rtol=1e-5)


def test_initial_logits_are_zero():
    """adaLN-zero: the megatron initialisation, and the dense model holding it, start at logits 0."""
    model = build_megatron("bidirectional", randomise=False)
    ids, positions, sigma = inputs()
    with torch.no_grad():
        assert torch.count_nonzero(megatron_logits(model, ids, positions, sigma)) == 0
        assert torch.count_nonzero(dense_logits(dense(model, "bidirectional"), ids, positions, sigma)) == 0


def dense_mdlm_loss(logits, ids, targets, mask_id, vocab_size):
    """MDLM low-var loss written densely on [b, s, V] logits (mask and padding ids suppressed)."""
    suppress = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    suppress[mask_id] = True
    suppress[vocab_size:] = True
    logits = logits.masked_fill(suppress, float("-inf"))
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (nll.view_as(targets) * (ids == mask_id)).sum() / targets.numel()


@pytest.mark.parametrize("backend", ["local", "sdpa"])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_gradients_match_dense_model(attention, backend):
    model = build_megatron(attention, attention_backend=backend)
    ref = dense(model, attention)
    family = get_family("mdlm", MASK_ID, VOCAB)
    gen = torch.Generator().manual_seed(5)
    targets = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=gen).to(DEVICE)
    ids, positions, sigma = inputs(1)
    ids = torch.where(ids == MASK_ID, ids, targets)
    inp = type("Inp", (), dict(input_ids=ids, targets=targets, valid=torch.ones(BATCH, SEQ, device=DEVICE)))

    model.zero_grad()
    loss_m = family.loss(model(ids, positions, sigma), inp).sum() / inp.valid.sum()
    loss_m.backward()
    loss_r = dense_mdlm_loss(dense_logits(ref, ids, positions, sigma), ids, targets, MASK_ID, VOCAB)
    loss_r.backward()
    torch.testing.assert_close(loss_m, loss_r, atol=1e-5, rtol=1e-5)
    assert_grads_match(model, ref)


def assert_grads_match(model, ref) -> None:
    """Every gradient of the megatron model equals the dense model's (each relative to its largest
    entry), and the embedding and attention gradients are not all zero."""
    grads_m = export.megatron_to_hf({n: p.grad for n, p in model.named_parameters()},
                                    PRESET.num_attention_heads, PADDED)  # on the CPU
    grads_r = {n: p.grad.cpu() for n, p in ref.named_parameters()}
    assert grads_m.keys() == grads_r.keys()
    for name in grads_r:
        scale = grads_r[name].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(grads_m[name] / scale, grads_r[name] / scale, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert grads_r["backbone.vocab_embed.weight"].abs().sum() > 0
    assert grads_r["backbone.blocks.0.attn_qkv.weight"].abs().sum() > 0
