"""BD3-LM (block diffusion): the block mask against its definition, the per-block noise, and the
two reductions, B = L to MDLM / Duo and B = 1 to an autoregressive model, in float64 on the dense
DiT (`hf/modeling_dllm.py`) with random weights. The megatron backbone's mask path (local against
SDPA, TP=2) is covered by the attention-backend tests, whose families include bd3lm."""
import pytest
import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families import ModelInput, Noise, get_family
from megatron_dllm.families.bd3lm import block_diffusion_mask
from megatron_dllm.hf.configuration_dllm import DLLMConfig
from megatron_dllm.hf.modeling_dllm import DiT

VOCAB, MASK_ID, L, BATCH = 50, 49, 12, 3

pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest: the loss heads are vocab-parallel


def reference_mask(length: int, block: int) -> torch.Tensor:
    """The BD3-LM mask written pair by pair from its definition (True = may attend)."""
    out = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    for q in range(2 * length):
        for k in range(2 * length):
            q_clean, k_clean = q >= length, k >= length
            qb, kb = (q % length) // block, (k % length) // block
            if q_clean == k_clean and qb == kb:
                out[q, k] = True  # own block, same copy
            elif not q_clean and k_clean and kb < qb:
                out[q, k] = True  # a noised block sees the clean blocks before it
            elif q_clean and k_clean and kb <= qb:
                out[q, k] = True  # clean copy: block-causal
    return out


@pytest.mark.parametrize("length,block", [(8, 1), (8, 2), (12, 3), (8, 4), (8, 8)])
def test_block_mask_matches_its_definition(length, block):
    mask = block_diffusion_mask(length, block)
    assert torch.equal(mask, reference_mask(length, block))
    # clean tokens never see noised ones; every row attends somewhere
    assert not mask[length:, :length].any() and mask.any(1).all()


def dense_model(seed: int = 0) -> DiT:
    """A float64 dense DiT with random weights everywhere (adaLN and head too: non-trivial logits)."""
    torch.manual_seed(seed)
    model = DiT(DLLMConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=VOCAB, mask_token_id=MASK_ID,
                           cond_dim=16, time_freq_dim=16, max_position_embeddings=2 * L)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "output_layer" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def logits_of(model: DiT, inp: ModelInput) -> torch.Tensor:
    """[s, b, V] as the family heads take them; the family's mask (True = masked out) if it has one."""
    mask = None if inp.attention_mask is None else ~inp.attention_mask
    with torch.no_grad():
        out = model(inp.input_ids, inp.position_ids, inp.sigma.double(), attn_mask=mask)
    return out.transpose(0, 1).contiguous()


def tokens_and_noise(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MASK_ID, (BATCH, L), generator=gen)
    ids = torch.arange(10, 10 + BATCH)
    return tokens, Noise(seed, ids, strata=torch.arange(BATCH), num_strata=BATCH)


def test_input_layout_and_per_block_t():
    family = get_family("bd3lm", MASK_ID, VOCAB, block_size=4)
    tokens, noise = tokens_and_noise()
    inp = family.corrupt(tokens, noise)
    assert torch.equal(inp.input_ids[:, L:], tokens)  # the clean copy second
    assert torch.equal(inp.position_ids, torch.arange(L).repeat(2).expand(BATCH, 2 * L))
    assert inp.sigma.abs().sum() == 0
    t = inp.t.view(BATCH, L // 4, 4)
    assert torch.equal(t, t[..., :1].expand_as(t))  # one t per block
    # stratified over samples x blocks: each of the 9 strata holds exactly one draw
    strata = (t[..., 0].double() * BATCH * (L // 4)).floor().flatten().sort().values
    assert torch.equal(strata, torch.arange(BATCH * (L // 4), dtype=torch.float64))
    masked = inp.input_ids[:, :L] == MASK_ID
    assert masked.any() and (~masked).any()
    assert torch.equal(inp.input_ids[:, :L][~masked], tokens[~masked])


def test_clipped_schedule_and_evaluation_range():
    family = get_family("bd3lm", MASK_ID, VOCAB, block_size=2, sampling_eps_min=0.5, sampling_eps_max=0.8)
    tokens, noise = tokens_and_noise()
    t = family.corrupt(tokens, noise).t
    assert t.min() >= 0.5 and t.max() <= 0.8
    full = family.evaluation().corrupt(tokens, noise).t
    assert full.min() < 0.5  # validation reports the bound over the full range
    with pytest.raises(InputError, match="--sampling-eps-min"):
        get_family("bd3lm", MASK_ID, VOCAB, block_size=2, sampling_eps_min=0.9, sampling_eps_max=0.5)
    with pytest.raises(InputError, match="--block-size 5 must divide"):
        family_5 = get_family("bd3lm", MASK_ID, VOCAB, block_size=5)
        family_5.corrupt(tokens, noise)


@pytest.mark.parametrize("noise_kind,single", [("mask", "mdlm"), ("uniform", "duo")])
def test_one_block_is_mdlm_or_duo(noise_kind, single):
    """B = L: the same t and draws as MDLM / Duo, and the same NELBO on the same model (whose x_t
    half then sees nothing of the clean copy). BD3-LM passes sigma = 0, so Duo runs at sigma = 0 too."""
    family = get_family("bd3lm", MASK_ID, VOCAB, block_size=L, noise=noise_kind)
    other = get_family(single, MASK_ID, VOCAB)
    model = dense_model()
    tokens, noise = tokens_and_noise(1)
    inp, ref = family.corrupt(tokens, noise), other.corrupt(tokens, noise)
    assert torch.equal(inp.input_ids[:, :L], ref.input_ids)
    assert torch.equal(inp.t, ref.t[:, None].expand(BATCH, L))
    ref.sigma = torch.zeros(BATCH)
    got, want = family.nelbo(logits_of(model, inp), inp), other.nelbo(logits_of(model, ref), ref)
    assert want.abs().sum() > 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # and a smaller block is another bound (the clean copy is seen): the comparison can fail
    small = get_family("bd3lm", MASK_ID, VOCAB, block_size=L // 2, noise=noise_kind)
    other_inp = small.model_input(tokens, inp.input_ids[:, :L], inp.t)
    assert (small.nelbo(logits_of(model, other_inp), other_inp) - want).abs().max() > 1e-3


def test_block_size_one_is_autoregressive():
    """B = 1, mask noise: a masked token sees only the clean tokens before it, so its logits are the
    autoregressive model's p(x_i | x_<i) (a causal pass over x_<i followed by [MASK] at i), whatever
    else is masked; the NELBO of a masked token is (1/t) -log p(x_i | x_<i), and its expectation over
    the masking is (1 - eps) times the exact NLL that the AR family's head computes on those logits."""
    family = get_family("bd3lm", MASK_ID, VOCAB, block_size=1)
    ar = get_family("ar", MASK_ID, VOCAB)
    model = dense_model(2)
    tokens, noise = tokens_and_noise(2)
    # the AR reference, one causal pass per position
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    ref = []
    for i in range(L):
        seq = torch.cat([tokens[:, :i], torch.full((BATCH, 1), MASK_ID)], dim=1)
        with torch.no_grad():
            out = model(seq, torch.arange(i + 1).expand(BATCH, i + 1), torch.zeros(BATCH, dtype=torch.float64),
                        attn_mask=causal[:i + 1, :i + 1])
        ref.append(out[:, i])
    ref_logits = torch.stack(ref)  # [L, b, V]
    ar_nll = ar.nelbo(ref_logits.clone(), ModelInput(tokens, None, None, tokens, torch.ones(BATCH, L), None))

    t = torch.rand(BATCH, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.9 + 0.1
    all_masked = family.model_input(tokens, torch.full_like(tokens, MASK_ID), t)
    logits = logits_of(model, all_masked)
    torch.testing.assert_close(logits[:L], ref_logits, rtol=1e-9, atol=1e-9)
    nelbo = family.nelbo(logits, all_masked)
    torch.testing.assert_close(nelbo * all_masked.t, ar_nll.float(), rtol=1e-5, atol=1e-6)

    # any other masking: the masked tokens' logits are unchanged, so E[NELBO] = (1 - eps) NLL
    inp = family.corrupt(tokens, noise)
    masked = inp.input_ids[:, :L] == MASK_ID
    assert masked.any() and (~masked).any()
    partial = logits_of(model, inp)[:L].transpose(0, 1)
    torch.testing.assert_close(partial[masked], ref_logits.transpose(0, 1)[masked], rtol=1e-9, atol=1e-9)
    per_token = family.nelbo(logits_of(model, inp), inp)
    assert torch.all(per_token[~masked] == 0)
    torch.testing.assert_close(per_token[masked], (ar_nll / inp.t)[masked], rtol=1e-5, atol=1e-6)
    # P(masked) x weight = (1 - alpha_t) / t = 1 - eps for every t: E[NELBO] = (1 - eps) NLL
    t = inp.t.double()
    torch.testing.assert_close((1 - family.schedule.alpha(t)) / t, torch.full_like(t, 1 - family.schedule.eps))


def test_loss_ignores_the_clean_copy():
    """No gradient reaches the clean copy's logits; the noised copy's unmasked tokens carry none."""
    family = get_family("bd3lm", MASK_ID, VOCAB, block_size=4)
    tokens, noise = tokens_and_noise(3)
    inp = family.corrupt(tokens, noise)
    logits = torch.randn(2 * L, BATCH, VOCAB, dtype=torch.float64, requires_grad=True)
    family.loss(logits.clone(), inp).sum().backward()
    assert logits.grad[L:].abs().sum() == 0
    clean = (inp.input_ids[:, :L] != MASK_ID).t()
    assert logits.grad[:L][clean].abs().sum() == 0 and logits.grad[:L][~clean].abs().sum() > 0


def test_bad_settings_are_one_line():
    with pytest.raises(InputError, match="--block-size"):
        get_family("bd3lm", MASK_ID, VOCAB)
    with pytest.raises(InputError, match="--noise"):
        get_family("bd3lm", MASK_ID, VOCAB, block_size=2, noise="gaussian")


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_megatron_block_mask_matches_dense_model(backend):
    """The megatron backbone on [x_t ; x_0] with the block mask (megatron-core's core attention and
    SDPA) gives the dense DiT's logits under the same mask; without the mask they differ."""
    from test_reference_dit import BATCH as B
    from test_reference_dit import DEVICE, SEQ, build_megatron, dense
    from test_reference_dit import MASK_ID as MID
    from test_reference_dit import VOCAB as V

    family = get_family("bd3lm", MID, V, block_size=4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MID, (B, SEQ // 2), generator=gen)
    ids = torch.arange(B)
    inp = family.corrupt(tokens, Noise(0, ids, ids, B)).to(DEVICE)
    model = build_megatron(family.attention, attention_backend=backend)
    with torch.no_grad():
        got = model(inp.input_ids, inp.position_ids, inp.sigma, inp.attention_mask).transpose(0, 1)
        ref = dense(model, "bidirectional")
        want = ref(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma,
                   attention_mask=~inp.attention_mask[:, 0].expand(B, -1, -1)).logits
        unmasked = ref(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma).logits
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (unmasked - want)[:, :SEQ // 2].abs().max() > 1e-2


# The flag rules (--block-size without bd3lm, missing, not dividing --seq-length) are rows of
# tests/test_validate.py, which checks that validate() itself raises each one.
