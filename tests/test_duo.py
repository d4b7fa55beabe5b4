"""Duo (uniform-state diffusion): the vocab-parallel closed-form NELBO against the reference formula
written densely, at TP=1 (TP=2: tests/test_vocab_parallel.py), in fp32 and bf16; the forward
process; real-text training."""
import math

import pytest
import torch
from test_vocab_parallel import assert_gradient_in_logits_storage

from megatron_dllm.families import Noise, duo, get_family, vocab_parallel

VOCAB, PADDED, MASK = 50, 64, 49  # ids < 50 incl. [MASK] = 49; TP padding 50..63
V = VOCAB - 1                     # ids a token can take: the real vocabulary minus [MASK]
EPS = 1e-3


def dense_duo_nelbo(logits_sbv: torch.Tensor, z: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Reference §2.3 `nll_per_token`, plainly, over the V real ids (0..48 here): [b, s]."""
    logits = logits_sbv.transpose(0, 1)[..., :MASK]       # drop [MASK] and padding: [b, s, V]
    x_theta = logits.softmax(-1)
    a = (1 - (1 - EPS) * t)[:, None].to(logits.dtype)      # alpha_t, [b, 1]
    da = -(1 - EPS)
    xbar_theta = V * a[..., None] * x_theta + (1 - a[..., None])
    e = (x == z).to(logits.dtype)
    xbar_z = (1 - a) + V * a * e
    c = (1 - a) / (V * a + 1 - a)
    xbar_theta_z = xbar_theta.gather(-1, z[..., None])[..., 0]
    xbar_theta_x = xbar_theta.gather(-1, x[..., None])[..., 0]
    term1 = V * (1 / xbar_z - 1 / xbar_theta_z)
    term2 = (-(e * c + (1 - e)) * (xbar_theta.log().sum(-1) - V * xbar_theta_z.log())
             - (V * a / (1 - a)) * (xbar_theta_x.log() - xbar_theta_z.log()) * (1 - e)
             + ((V - 1) * c * e - (1 - e) / c) * c.log())
    return (da / (V * a)) * (term1 - term2)


def make_case(t_value: float, b: int = 4, s: int = 48, seed: int = 0):
    """(family, ModelInput, logits [s, b, PADDED]) with z_t = x and z_t != x both present."""
    gen = torch.Generator().manual_seed(seed)
    family = get_family("duo", MASK, VOCAB)
    x = torch.randint(0, MASK, (b, s), generator=gen)
    ids = torch.arange(b)
    inp = family.corrupt(x, Noise(5, ids, strata=ids, num_strata=b))
    inp.t = torch.full((b,), t_value)
    z = inp.input_ids.clone()
    z[:, 0::3] = x[:, 0::3]                       # kept
    z[:, 1::3] = (x[:, 1::3] + 7) % MASK          # replaced by another real id
    inp.input_ids = z
    logits = 3 * torch.randn(s, b, PADDED, generator=gen)
    return family, inp, logits


def family_loss_and_grad(family, inp, logits, dtype=torch.float32, compiled=False):
    leaf = logits.detach().to(dtype).clone().requires_grad_()
    with vocab_parallel.compiled_heads(compiled):  # the backward below runs after it closed, as in training
        loss = family.loss(leaf.clone(), inp)
    loss.sum().backward()
    return loss.detach(), leaf.grad


def dense_loss_and_grad(inp, logits):
    leaf = logits.detach().double().requires_grad_()
    loss = dense_duo_nelbo(leaf, inp.input_ids, inp.targets, inp.t.double())
    loss.sum().backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("chunk_rows, compiled", [(None, False), (5, False), (1, False), (5, True)],
                         ids=["eager", "eager-chunks-of-5", "eager-chunks-of-1", "compiled"])
@pytest.mark.parametrize("t_value", [EPS, 0.5, 1.0])
def test_loss_and_grad_equal_dense_reference_tp1(t_value, chunk_rows, compiled, world_of_one, monkeypatch):
    """Also with the vocabulary work in chunks of 5 rows (the last one partial) and of 1 row, as
    `duo.CHUNK_ELEMENTS` splits real batches (None: one chunk here), and with the chunk bodies
    compiled, which take all rows at once whatever the chunk size (the backward runs after the
    context closed, as autograd runs it)."""
    if chunk_rows is not None:
        monkeypatch.setattr(duo, "CHUNK_ELEMENTS", chunk_rows * PADDED)
    family, inp, logits = make_case(t_value)
    assert (inp.input_ids == inp.targets).any() and (inp.input_ids != inp.targets).any()
    got, grad = family_loss_and_grad(family, inp, logits, compiled=compiled)
    ref, ref_grad = dense_loss_and_grad(inp, logits)
    assert torch.isfinite(got).all() and (ref > 0).all()
    # relative 1e-5; tokens whose loss is a near-total cancellation (e = 1, x_theta[z] ~ 1, loss
    # ~1e-3 of its terms) are held to 1e-5 of the batch's mean token loss instead
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().mean().item())
    with vocab_parallel.compiled_heads(compiled):
        assert torch.allclose(family.nelbo(logits.clone(), inp), got)
    scale = ref_grad.abs().amax()
    assert (grad.double() - ref_grad).abs().max() <= 1e-5 * scale
    assert (grad[..., VOCAB:] == 0).all() and (grad[..., MASK] == 0).all()  # padding and [MASK]


@pytest.mark.parametrize("t_value", [EPS, 1.0])
def test_bf16_logits_are_finite_and_close_to_fp32(t_value, world_of_one):
    family, inp, logits = make_case(t_value)
    bf16_loss, bf16_grad = family_loss_and_grad(family, inp, logits, torch.bfloat16)
    assert bf16_grad.dtype == torch.bfloat16 and torch.isfinite(bf16_grad.float()).all()
    assert torch.isfinite(bf16_loss).all()
    rounded, _ = family_loss_and_grad(family, inp, logits.bfloat16().float())
    assert torch.allclose(bf16_loss, rounded, rtol=1e-5)  # fp32 inside: same as fp32 on the bf16 values
    fp32, _ = family_loss_and_grad(family, inp, logits)
    assert (bf16_loss.sum() / fp32.sum() - 1).abs() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_lives_in_the_logits_storage(dtype, world_of_one, monkeypatch):
    monkeypatch.setattr(duo, "CHUNK_ELEMENTS", 4 * PADDED)
    family, inp, logits = make_case(0.5)
    assert_gradient_in_logits_storage(lambda out: family.loss(out, inp), logits.to(dtype))


def test_unknown_loss_lists_valid_ones():
    from megatron_dllm.config import parse_flags, validate

    with pytest.raises(ValueError, match="--loss low-var is not available for --family duo; valid: nelbo"):
        validate(parse_flags(["--family", "duo", "--loss", "low-var"]))
    with pytest.raises(ValueError, match="--loss low-var is not available for --family duo; valid: nelbo"):
        get_family("duo", 4, 5, "low-var")  # the family itself refuses, for callers that skip validation


def test_corrupt_replaces_uniformly_with_real_ids(world_of_one):
    family = get_family("duo", MASK, VOCAB)
    b, s = 16, 4096
    tokens = torch.full((b, s), 3)
    ids = torch.arange(100, 100 + b)
    noise = Noise(11, ids, strata=ids - 100, num_strata=b)
    inp = family.corrupt(tokens, noise)
    z_t, t, replaced = family.replace(tokens, noise)
    alpha = 1 - (1 - EPS) * t
    assert torch.equal(z_t, inp.input_ids) and torch.equal(inp.targets, tokens)
    assert torch.allclose(inp.sigma.double(), -torch.log(alpha), rtol=1e-6)
    assert torch.allclose(inp.t.double(), t, rtol=1e-6)
    rate = replaced.double().mean(1)
    assert ((rate - (1 - alpha)).abs() < 4 * torch.sqrt((1 - alpha) * alpha / s) + 1e-9).all()
    changed = (z_t != tokens).double().mean(1)  # a redraw lands on x with probability 1/V
    assert ((changed - (1 - alpha) * (1 - 1 / V)).abs() < 5 * torch.sqrt(0.25 / torch.tensor(s))).all()
    assert (z_t != MASK).all() and (z_t < VOCAB).all() and (z_t >= 0).all()
    drawn = z_t[replaced]
    counts = torch.bincount(drawn, minlength=VOCAB).double()
    assert counts[MASK] == 0 and (counts[:MASK] > 0).all()
    assert counts[:MASK].std() / counts[:MASK].mean() < 0.15  # uniform over the 49 real ids
    # a pure function of (seed, sample index): the same sample in another batch position/size
    again = family.corrupt(tokens[5:7], Noise(11, ids[5:7], strata=ids[5:7] - 100, num_strata=b))
    assert torch.equal(again.input_ids, inp.input_ids[5:7])
    other = family.corrupt(tokens[5:7], Noise(12, ids[5:7], strata=ids[5:7] - 100, num_strata=b))
    assert not torch.equal(other.input_ids, inp.input_ids[5:7])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_text_training_validation_nelbo_falls(pretrain):
    _, records = pretrain(2, "--family", "duo", "--preset", "cpu-tiny", "--train-iters", "40",
                          "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "2")
    train = [r["loss"] for r in records if "loss" in r]
    valid = [r["valid_nelbo"] for r in records if "valid_nelbo" in r]
    assert len(train) == 4 and len(valid) == 2 and all(map(math.isfinite, train + valid))
    assert valid[-1] < valid[0] and train[-1] < train[0], (train, valid)
