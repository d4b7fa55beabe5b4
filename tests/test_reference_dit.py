"""The megatron-core DiTModel against a plain-PyTorch DiT written from reference-algorithms.md §1.

Single process on CPU (world size 1, TP=1, PP=1): the megatron model's weights are loaded into
`ReferenceDiT` and logits and gradients must agree in fp32.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.model.presets import Preset
from megatron_dllm.model.reference import ReferenceDiT, megatron_to_reference

VOCAB, SEQ, BATCH = 300, 32, 3
MASK_ID = VOCAB - 1
PRESET = Preset(64, 2, 4)


@pytest.fixture(scope="module", autouse=True)
def distributed():
    platform.init_distributed(1, 1, seed=0)
    yield
    platform.destroy_distributed()


def build_megatron(attention: str, randomise: bool = True):
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config

    arch = Architecture(PRESET, VOCAB, SEQ, attention)
    config, mlp_config = transformer_config(arch)
    model = build_model(arch, config, mlp_config, seed=0)[0]
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
    return ids, positions, sigma


def megatron_logits(model, ids, positions, sigma):
    return model(ids, positions, sigma).transpose(0, 1)  # [s, b, V] -> [b, s, V]


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_logits_match_reference(attention):
    model = build_megatron(attention)
    ref = ReferenceDiT.from_megatron_state_dict(model.state_dict(), PRESET.num_attention_heads,
                                                causal=attention == "causal")
    ids, positions, sigma = inputs()
    with torch.no_grad():
        got = megatron_logits(model, ids, positions, sigma)
        want = ref(ids, positions, sigma)
    assert got.shape == want.shape == (BATCH, SEQ, 384)  # padded vocabulary kept
    assert want.abs().max() > 1.0  # non-trivial
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Sliced to the real vocabulary: the same logits, without the padded rows.
    sliced = ReferenceDiT.from_megatron_state_dict(model.state_dict(), PRESET.num_attention_heads,
                                                   causal=attention == "causal", vocab_size=VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(sliced(ids, positions, sigma), got[..., :VOCAB], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_positions_matter(attention):
    """Permuted positions give different logits than identity positions (rotary is live), and
    permuting tokens together with their positions permutes the bidirectional output."""
    model = build_megatron(attention)
    ids, positions, sigma = inputs()
    identity = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        a = megatron_logits(model, ids, positions, sigma)
        b = megatron_logits(model, ids, identity, sigma)
        assert (a - b).abs().max() > 1e-3
        if attention == "bidirectional":
            perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
            c = megatron_logits(model, ids[:, perm], positions[:, perm], sigma)
            torch.testing.assert_close(c, a[:, perm], atol=1e-5, rtol=1e-5)


def test_initial_logits_are_zero():
    model = build_megatron("bidirectional", randomise=False)
    ids, positions, sigma = inputs()
    with torch.no_grad():
        logits = megatron_logits(model, ids, positions, sigma)
    assert torch.count_nonzero(logits) == 0
    ref = ReferenceDiT(PRESET.hidden_size, PRESET.num_layers, PRESET.num_attention_heads, VOCAB, causal=False)
    with torch.no_grad():
        assert torch.count_nonzero(ref(ids, positions, sigma)) == 0


def dense_mdlm_loss(logits, ids, targets, mask_id, vocab_size):
    """MDLM low-var loss written densely on [b, s, V] logits (mask and padding ids suppressed)."""
    suppress = torch.zeros(logits.shape[-1], dtype=torch.bool)
    suppress[mask_id] = True
    suppress[vocab_size:] = True
    logits = logits.masked_fill(suppress, float("-inf"))
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (nll.view_as(targets) * (ids == mask_id)).sum() / targets.numel()


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_gradients_match_reference(attention):
    model = build_megatron(attention)
    ref = ReferenceDiT.from_megatron_state_dict(model.state_dict(), PRESET.num_attention_heads,
                                                causal=attention == "causal")
    family = get_family("mdlm", MASK_ID, VOCAB)
    gen = torch.Generator().manual_seed(5)
    targets = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=gen)
    ids, positions, sigma = inputs(1)
    ids = torch.where(ids == MASK_ID, ids, targets)
    inp = type("Inp", (), dict(input_ids=ids, targets=targets, valid=torch.ones(BATCH, SEQ)))

    model.zero_grad()
    loss_m = family.loss(model(ids, positions, sigma), inp).sum() / inp.valid.sum()
    loss_m.backward()
    loss_r = dense_mdlm_loss(ref(ids, positions, sigma), ids, targets, MASK_ID, VOCAB)
    loss_r.backward()
    torch.testing.assert_close(loss_m, loss_r, atol=1e-5, rtol=1e-5)

    grads_m = megatron_to_reference({n: p.grad for n, p in model.named_parameters()},
                                    PRESET.num_attention_heads)
    grads_r = {n: p.grad for n, p in ref.named_parameters()}
    assert grads_m.keys() == grads_r.keys()
    for name in grads_r:
        scale = grads_r[name].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(grads_m[name] / scale, grads_r[name] / scale, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert grads_r["vocab_embed"].abs().sum() > 0 and grads_r["blocks.0.attn_qkv.weight"].abs().sum() > 0
