"""Eso-LM (alpha_0 = 1): the shuffle kernels against the torch reference, the causal-over-shuffled
attention against an explicit mask on the unshuffled sequence, corruption as a pure function of
the sample, and real-text training."""
import math

import pytest
import torch

from megatron_dllm import platform
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.families import Noise, get_family
from megatron_dllm.families import shuffle as S
from megatron_dllm.families.esolm import EsoLM, unpermute
from megatron_dllm.hf import export
from megatron_dllm.model.presets import Preset

VOCAB, SEQ, BATCH = 300, 32, 3
MASK_ID = VOCAB - 1
PRESET = Preset(64, 2, 4)


# ----------------------------------------------------------------------------- shuffle kernels

def _case(pattern: str, B: int, L: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + B * 31 + L)
    if pattern == "all-masked":
        mask = torch.ones(B, L, dtype=torch.bool)
    elif pattern == "none-masked":
        mask = torch.zeros(B, L, dtype=torch.bool)
    else:
        mask = torch.rand(B, L, generator=gen) < torch.rand(B, 1, generator=gen)
    u = torch.rand(B, L, generator=gen, dtype=dtype)
    if pattern == "tied":  # exact ties, and near-ties that 1 + 0.9u rounds together
        u[:, ::3] = u[:, :1].clone()
        u[:, 1::4] = u[:, 1:2] + torch.rand(B, 1, generator=gen, dtype=dtype) * 1e-12
        u[:, 2::5] = 0.0
    z = torch.randint(0, 1000, (B, L), generator=gen)
    x0 = torch.randint(0, 1000, (B, L), generator=gen)
    pos = torch.arange(L).expand(B, L)
    return mask, u, z, x0, pos


def _python_reference(mask, u):
    """The definition, spelled out: sort by (computed key, index)."""
    keys = S.sort_keys(mask, u).tolist()
    return torch.tensor([sorted(range(len(row)), key=lambda i: (row[i], i)) for row in keys])


PATTERNS = ["random", "all-masked", "none-masked", "tied"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_torch_reference_is_the_definition(pattern, dtype):
    mask, u, z, x0, pos = _case(pattern, 4, 97, dtype)
    sort_idx, zs, x0s, ps = S.shuffle_torch(mask, u, z, x0, pos)
    assert torch.equal(sort_idx, _python_reference(mask, u))
    assert torch.equal(zs, z.gather(1, sort_idx)) and torch.equal(ps, sort_idx)
    m = mask.gather(1, sort_idx).int()
    assert (m.diff(dim=1) >= 0).all()  # clean first, then masked


def test_the_cpp_extension_is_built():
    """setup.py always builds the C++ shuffle (it needs no GPU): missing means a failed build."""
    assert S.HAVE_CPP, "megatron_dllm._esolm_shuffle did not build; see the pip install log"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("L", [1, 7, 128, 2048])
@pytest.mark.parametrize("B", [1, 8])
def test_cpp_matches_torch_bit_for_bit(B, L, pattern, dtype):
    mask, u, z, x0, pos = _case(pattern, B, L, dtype)
    want = S.shuffle(mask, u, z, x0, pos, backend="torch")
    got = S.shuffle(mask, u, z, x0, pos, backend="cpp")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b)
    sort_idx = got[0]
    for x in (torch.randn(B, L, 3, 5), torch.randint(0, 9, (B, L)), torch.randn(B, L).bfloat16()):
        shuffled = x[torch.arange(B)[:, None], sort_idx]
        back = S.unpermute(shuffled, sort_idx, backend="cpp")
        assert torch.equal(back, x)  # inverse o shuffle = identity
        assert torch.equal(back, S.unpermute(shuffled, sort_idx, backend="torch"))
    inv = S.inverse(sort_idx, backend="cpp")
    assert torch.equal(sort_idx.gather(1, inv), torch.arange(L).expand(B, L))


def test_auto_dispatch_and_autograd():
    mask, u, z, x0, pos = _case("random", 2, 16, torch.float64)
    sort_idx = S.shuffle(mask, u, z)[0]
    x = torch.randn(2, 16, 4, requires_grad=True)  # grad: the torch path, differentiable
    S.unpermute(x, sort_idx).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="backend"):
        S.shuffle(mask, u, z, backend="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("L", [1, 7, 128, 2048, 4096])
@pytest.mark.parametrize("B", [1, 8])
def test_cuda_matches_torch_bit_for_bit(B, L, pattern, dtype):
    assert S.HAVE_CUDA, "megatron_dllm._esolm_shuffle_cuda is not built (python setup.py build_ext --inplace)"
    mask, u, z, x0, pos = _case(pattern, B, L, dtype)
    want = S.shuffle(mask, u, z, x0, pos, backend="torch")
    got = S.shuffle(mask.cuda(), u.cuda(), z.cuda(), x0.cuda(), pos.cuda(), backend="cuda")
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    sort_idx = got[0]
    for x in (torch.randn(B, L, 3, 5), torch.randn(B, L, 8).bfloat16(), torch.randint(0, 9, (B, L))):
        x = x.cuda()
        shuffled = x[torch.arange(B, device="cuda")[:, None], sort_idx]
        assert torch.equal(S.unpermute(shuffled, sort_idx, backend="cuda"), x)


# ----------------------------------------------------------------------------- the family

def _noise(sample_ids, strata=None, n=None, seed=0):
    sample_ids = torch.as_tensor(sample_ids)
    strata = torch.arange(len(sample_ids)) if strata is None else torch.as_tensor(strata)
    return Noise(seed, sample_ids, strata, n or len(sample_ids))


def _tokens(b=BATCH, s=SEQ, seed=0):
    return torch.randint(0, VOCAB - 1, (b, s), generator=torch.Generator().manual_seed(seed))


def test_registry_and_losses():
    fam = get_family("esolm", MASK_ID, VOCAB)
    assert isinstance(fam, EsoLM) and fam.attention == "causal" and fam.loss_type == "low-var"
    assert get_family("esolm", MASK_ID, VOCAB, "nelbo").loss_type == "nelbo"
    # a loss the family lacks (--loss): the family_loss rows of tests/test_validate.py, raised by validate()


def test_corrupt_is_a_pure_function_of_the_sample(monkeypatch):
    fam = EsoLM(MASK_ID, VOCAB)
    tokens = _tokens(4, 64)
    noise = _noise([11, 5, 42, 7], n=4)
    a, b = fam.corrupt(tokens, noise), fam.corrupt(tokens.clone(), noise)
    fields = [k for k, value in a.__dict__.items() if value is not None]  # Eso-LM sets no attention_mask
    for k in fields:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    # Same samples in another order of the micro-batch: the same rows, reordered.
    order = torch.tensor([2, 0, 3, 1])
    c = fam.corrupt(tokens[order], _noise(noise.sample_ids[order], noise.strata[order], 4))
    for k in ("input_ids", "position_ids", "targets", "t"):
        assert torch.equal(getattr(c, k), getattr(a, k)[order]), k
    # The C++ and the torch shuffle give the same corruption.
    monkeypatch.setenv("MEGATRON_DLLM_SHUFFLE_BACKEND", "torch")
    d = fam.corrupt(tokens, noise)
    for k in fields:
        assert torch.equal(getattr(d, k), getattr(a, k)), k


def test_corrupt_shuffles_mdlm_corruption_clean_first():
    fam, mdlm = EsoLM(MASK_ID, VOCAB), get_family("mdlm", MASK_ID, VOCAB)
    tokens = _tokens(8, 128)
    noise = _noise(range(100, 108), n=8)
    inp, ref = fam.corrupt(tokens, noise), mdlm.corrupt(tokens, noise)
    pos = inp.position_ids
    assert torch.equal(pos.sort(dim=1).values, torch.arange(128).expand(8, 128))  # a permutation
    assert torch.equal(inp.input_ids, ref.input_ids.gather(1, pos))  # MDLM's z_t, shuffled
    assert torch.equal(inp.targets, tokens.gather(1, pos))
    assert torch.equal(inp.t, ref.t) and not inp.sigma.any() and bool((inp.valid == 1).all())
    is_mask = (inp.input_ids == MASK_ID).int()
    assert (is_mask.diff(dim=1) >= 0).all()  # every clean token before every masked one
    assert 0 < is_mask.sum() < is_mask.numel()
    keys = noise.uniform("shuffle", 128).gather(1, pos)
    for row in range(8):  # within each group, the order of the keys
        n_clean = int((is_mask[row] == 0).sum())
        assert (keys[row, :n_clean].diff() >= 0).all() and (keys[row, n_clean:].diff() >= 0).all()
    x = torch.randn(8, 128, 5)
    assert torch.equal(unpermute(x.gather(1, pos[..., None].expand(-1, -1, 5)), inp), x)


def _megatron_dit(attention="causal"):
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.init import initialize_weights

    arch = Architecture(PRESET, VOCAB, SEQ, attention)
    config, mlp_config = transformer_config(arch)
    model = build_model(arch, config, mlp_config, seed=0)[0]
    initialize_weights(model, seed=3, adaln_zero=False)  # adaLN/output non-zero: live logits
    return model.eval()


def test_masked_predictions_ignore_later_masked_tokens(world_of_one):
    model, fam = _megatron_dit(), EsoLM(MASK_ID, VOCAB)
    inp = fam.corrupt(_tokens(), _noise([1, 2, 3])).to(platform.device())
    with torch.no_grad():
        base = model(inp.input_ids, inp.position_ids, inp.sigma).transpose(0, 1)
        assert base.abs().max() > 0.1
        for row in range(BATCH):
            masked = (inp.input_ids[row] == MASK_ID).nonzero().flatten()
            assert len(masked) >= 3
            i = int(masked[len(masked) // 2])  # a masked token with masked tokens after it
            later = masked[masked > i]
            ids = inp.input_ids.clone()
            gen = torch.Generator().manual_seed(row)
            ids[row, later] = torch.randint(0, VOCAB - 1, (len(later),), generator=gen).to(ids.device)
            out = model(ids, inp.position_ids, inp.sigma).transpose(0, 1)
            torch.testing.assert_close(out[row, :i + 1], base[row, :i + 1], atol=1e-6, rtol=1e-6)
            assert (out[row, int(later[0])] - base[row, int(later[0])]).abs().max() > 1e-4


def test_causal_over_shuffled_equals_explicit_mask_in_sequence_order(world_of_one):
    model, fam = _megatron_dit(), EsoLM(MASK_ID, VOCAB)
    tokens = _tokens(seed=1)
    inp = fam.corrupt(tokens, _noise([4, 8, 15])).to(platform.device())
    model_identity = ModelIdentity("esolm", PRESET.hidden_size, PRESET.num_layers, PRESET.num_attention_heads,
                                   VOCAB, MASK_ID)
    ref = export.hf_model(model.state_dict(), model_identity, "causal", SEQ, model.padded_vocab_size)
    ref.to(platform.device())
    with torch.no_grad():
        shuffled = model(inp.input_ids, inp.position_ids, inp.sigma).transpose(0, 1)
        # The same weights on the unshuffled sequence: i attends to j iff rank(j) <= rank(i).
        rank = S.inverse(inp.position_ids)
        attn_mask = rank[:, None, :] <= rank[:, :, None]
        z_t = unpermute(inp.input_ids, inp)
        identity = torch.arange(SEQ, device=platform.device()).expand(BATCH, SEQ)
        want = ref(input_ids=z_t, position_ids=identity, sigma=inp.sigma, attention_mask=attn_mask).logits
        got = unpermute(shuffled, inp)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # And the loss: Eso-LM's on the shuffled logits = MDLM's on the unshuffled ones.
    mdlm = get_family("mdlm", MASK_ID, VOCAB)
    seq_inp = mdlm.corrupt(tokens, _noise([4, 8, 15])).to(platform.device())
    for loss_type in ("low-var", "nelbo"):
        e, m = EsoLM(MASK_ID, VOCAB, loss_type), get_family("mdlm", MASK_ID, VOCAB, loss_type)
        # the loss works in place
        le = e.loss(shuffled.transpose(0, 1).clone(memory_format=torch.contiguous_format), inp).sum()
        lm = m.loss(got.transpose(0, 1).clone(memory_format=torch.contiguous_format), seq_inp).sum()
        torch.testing.assert_close(le, lm, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- training

@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_text_training_nelbo_falls(pretrain):
    iters = 40
    proc, records = pretrain(2, "--family", "esolm", "--preset", "cpu-tiny", "--train-iters", str(iters),
                             "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "2")
    train = [r["loss"] for r in records if "loss" in r]
    valid = [r["valid_nelbo"] for r in records if "valid_nelbo" in r]
    assert len(train) == iters // 10 and len(valid) == 2, records
    assert train[-1] < train[0] and valid[-1] < valid[0], (train, valid)
    assert valid[-1] < math.log(4097), valid  # below the uniform bound log V
