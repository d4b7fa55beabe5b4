"""Attention-mask annealing (`--attention-mask-anneal-iters`, training/attention_anneal.py): the
schedule against its definition, written out pair by pair; the annealed mask through both
backbones against dense references (the dense DiT of every HF export, and transformers' Llama with
eager attention and an additive 4D mask, DiffuLLaMA's form); from iteration N on, the batches are
those of the plain bidirectional run bit for bit. The flag rules are rows of tests/test_validate.py;
the exact resume of an annealed run is tests/test_ar_adaptation.py."""
import pytest
import torch
from test_gpt_backbone import tiny_hf
from test_reference_dit import (
    BATCH,
    DEVICE,
    MASK_ID,
    SEQ,
    VOCAB,
    assert_grads_match,
    build_megatron,
    dense,
    dense_mdlm_loss,
)

from megatron_dllm.families import get_family
from megatron_dllm.seeding import seed_for
from megatron_dllm.training.attention_anneal import AttentionAnneal

pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest
N = 4


def dense_definition(iteration: int, length: int, seed: int) -> torch.Tensor:
    """allowed_k[i, j] = j <= i or u_k[i, j] < min(1, k / N), pair by pair, with u_k the
    iteration's uniform draw from (seed, k)."""
    gen = torch.Generator().manual_seed(seed_for(seed, "attention_anneal", iteration))
    u = torch.rand(length, length, generator=gen, dtype=torch.float64)
    ratio = min(1.0, iteration / N)
    return torch.tensor([[j <= i or u[i, j].item() < ratio for j in range(length)] for i in range(length)])


def test_the_schedule_goes_from_causal_to_bidirectional():
    length, anneal = 48, AttentionAnneal(N, seed=3)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    assert torch.equal(anneal.allowed(0, length), causal)  # k = 0: exactly the AR model's attention
    upper = ~causal
    for k in range(1, N):
        allowed = anneal.allowed(k, length)
        assert torch.equal(allowed, dense_definition(k, length, seed=3))
        assert torch.equal(anneal.attention_mask(k, length)[0, 0], ~allowed)  # megatron's True = masked out
        opened = allowed[upper].double().mean().item()  # 1128 pairs: a binomial within 5 sigma
        assert abs(opened - k / N) < 5 * (k / N * (1 - k / N) / upper.sum().item()) ** 0.5
    # each iteration draws afresh (as DiffuLLaMA), not a growing set: iteration 1's pairs are not all in 2's
    assert not torch.equal(anneal.allowed(1, length), anneal.allowed(2, length) & anneal.allowed(1, length))
    for k in (N, N + 1, 10 * N):  # from N on: bidirectional, and no mask at all (the family's layout)
        assert anneal.allowed(k, length).all() and anneal.attention_mask(k, length) is None
    # a pure function of (seed, k): history and call order change nothing (what an exact resume needs)
    fresh = AttentionAnneal(N, seed=3)
    assert all(torch.equal(fresh.attention_mask(k, length), anneal.attention_mask(k, length)) for k in (3, 1, 2))
    assert not torch.equal(AttentionAnneal(N, seed=4).allowed(2, length), anneal.allowed(2, length))


@pytest.mark.parametrize("family_name", ["mdlm", "duo"])
def test_batches_carry_the_iterations_mask_and_none_from_n_on(family_name):
    """Every micro-batch of iteration k carries that iteration's mask; from N on the inputs equal the
    plain (unannealed) schedule's bit for bit, so the step is the plain bidirectional step."""
    from megatron_dllm.training.batches import BatchSchedule

    family = get_family(family_name, MASK_ID, VOCAB)
    data = torch.randint(0, MASK_ID, (64, SEQ), generator=torch.Generator().manual_seed(0)).numpy()
    plain = BatchSchedule(data, family, seed=5, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1)
    annealed = BatchSchedule(data, family, seed=5, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1,
                             attention_anneal=AttentionAnneal(N, seed=5))
    want = ~AttentionAnneal(N, seed=5).allowed(2, SEQ)
    for inp in annealed.iteration(8, number=2):
        assert torch.equal(inp.attention_mask.cpu()[0, 0], want)
    for got, ref in zip(annealed.iteration(24, number=N), plain.iteration(24, number=N), strict=True):
        assert got.attention_mask is None
        for name, value in ref.__dict__.items():
            assert value is None or torch.equal(getattr(got, name), value), name


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_annealed_dit_step_equals_the_dense_model_under_that_mask(backend):
    """The DiT's training step (MDLM loss, backward) with iteration 2's mask: logits, loss and every
    gradient equal the dense DiT's under the same mask; the mask is live (unmasked logits differ)."""
    model = build_megatron("bidirectional", attention_backend=backend)
    ref = dense(model, "bidirectional")
    family = get_family("mdlm", MASK_ID, VOCAB)
    gen = torch.Generator().manual_seed(5)
    targets = torch.randint(0, MASK_ID, (BATCH, SEQ), generator=gen).to(DEVICE)
    ids = torch.where(torch.rand(BATCH, SEQ, generator=gen).to(DEVICE) < 0.5, MASK_ID, targets)
    positions, sigma = torch.arange(SEQ, device=DEVICE).expand(BATCH, SEQ), torch.zeros(BATCH, device=DEVICE)
    mask = AttentionAnneal(N, seed=1).attention_mask(2, SEQ).to(DEVICE)
    inp = type("Inp", (), dict(input_ids=ids, targets=targets, valid=torch.ones(BATCH, SEQ, device=DEVICE)))

    model.zero_grad()
    logits = model(ids, positions, sigma, mask)
    got = logits.detach().transpose(0, 1).clone()  # the vocab-parallel loss works in place
    (family.loss(logits, inp).sum() / inp.valid.sum()).backward()
    want = ref(input_ids=ids, position_ids=positions, sigma=sigma, attention_mask=~mask).logits
    dense_mdlm_loss(want, ids, targets, MASK_ID, VOCAB).backward()
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_match(model, ref)
    with torch.no_grad():
        unmasked = ref(input_ids=ids, position_ids=positions, sigma=sigma).logits
    assert (unmasked - want).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_annealed_gpt_backbone_equals_transformers_with_the_additive_mask(backend, tmp_path):
    """An imported Llama on the GPT backbone with iteration 2's mask gives transformers' logits
    (eager attention, DiffuLLaMA's additive 0 / finfo.min 4D mask), and the MDLM loss's gradient
    of the tied embedding is transformers' too."""
    import transformers

    from megatron_dllm.hf import pretrained_ar
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config

    hf = tiny_hf("llama", tmp_path)
    preset, shape, rows = pretrained_ar.shape_of(pretrained_ar.read_config(hf), hf)
    seq = 16
    arch = Architecture(preset, rows, seq, "bidirectional", make_vocab_size_divisible_by=1, gpt=shape)
    config, _ = transformer_config(arch)
    ours = build_model(arch, config, config, seed=0, attention_backend=backend)[0]
    ours.load_state_dict(pretrained_ar.to_megatron(pretrained_ar.read_weights(hf), preset, shape, hf))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    mask_id = rows - 1
    family = get_family("mdlm", mask_id, rows)
    gen = torch.Generator().manual_seed(1)
    targets = torch.randint(0, mask_id, (2, seq), generator=gen)
    ids = torch.where(torch.rand(2, seq, generator=gen) < 0.5, mask_id, targets)
    masked_out = AttentionAnneal(N, seed=2).attention_mask(2, seq)
    additive = torch.zeros(2, 1, seq, seq).masked_fill(masked_out, torch.finfo(torch.float32).min)

    logits = ours(ids.to(DEVICE), torch.arange(seq, device=DEVICE).expand(2, seq), None, masked_out.to(DEVICE))
    got = logits.detach().transpose(0, 1).cpu().clone()  # the vocab-parallel loss works in place
    inp = type("Inp", (), dict(input_ids=ids.to(DEVICE), targets=targets.to(DEVICE), valid=torch.ones(2, seq)))
    (family.loss(logits, inp).sum() / seq / 2).backward()
    want = ref(ids, attention_mask=additive).logits
    dense_mdlm_loss(want, ids, targets, mask_id, rows).backward()
    assert want.abs().max() > 1
    assert ((got - want.detach()).abs().max() / want.abs().max()).item() < 1e-5
    grad, ref_grad = ours.embedding.word_embeddings.weight.grad.cpu(), ref.model.embed_tokens.weight.grad
    assert ref_grad.abs().max() > 0 and ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item() < 1e-4
    with torch.no_grad():  # the mask is live: causal and bidirectional logits both differ
        for other in (None, torch.zeros(2, 1, seq, seq)):
            assert (ref(ids, attention_mask=other).logits - want).abs().max() > 1e-3
