"""The vocab-parallel cross entropy of MDLM, Eso-LM, AR and BD3-LM (`vocab_parallel.cross_entropy`)
against the dense formula in float64: loss and gradient in fp32 and bf16 (whole and in row
chunks), on one vocabulary shard and on two (TP=2, with Duo's head beside it), and its memory: the
gradient it returns lives in the logits' own storage and it saves nothing else logits-sized."""
import pytest
import torch
import torch.nn.functional as F
from conftest import run_worker_on_two_ranks

from megatron_dllm.families import vocab_parallel

VOCAB, PADDED, MASK = 50, 64, 49  # ids < 50 incl. [MASK] = 49; TP padding 50..63


def make_case(b: int = 4, s: int = 48, seed: int = 0):
    """(logits [s, b, PADDED], targets [b, s], per-token weights [b, s]: the loss's upstream
    gradient). Two tokens in three are predicted with confidence (loss ~1e-6: the gradient at the
    target is a small difference from 1); in every fifth row [MASK] and the padding have logits of
    200, far above the real ones, so a maximum taken over them would underflow every real exp()."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(s, b, PADDED, generator=gen)
    targets = torch.randint(0, MASK, (b, s), generator=gen)
    confident = torch.zeros(s, b, PADDED).scatter_(2, targets.t()[..., None], 15.0)
    confident[1::3] = 0
    logits += confident
    logits[::5, :, MASK:] = 200.0
    weights = torch.rand(b, s, generator=gen) + 0.5
    return logits, targets, weights


def dense_loss_and_grad(logits, targets, weights):
    """-log softmax over the real ids ([MASK] and padding dropped), float64: ([b, s], grad [s, b, PADDED])."""
    leaf = logits.detach().double().requires_grad_()
    real = leaf.transpose(0, 1)[..., :VOCAB].clone()
    real[..., MASK] = float("-inf")
    nll = F.cross_entropy(real.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view(targets.shape)
    (nll * weights).sum().backward()
    return nll.detach(), leaf.grad


def loss_and_grad(logits, targets, weights, dtype=torch.float32):
    leaf = logits.detach().to(dtype, copy=True).requires_grad_()
    nll = vocab_parallel.cross_entropy(leaf.clone(), targets, MASK, VOCAB)
    (nll * weights).sum().backward()
    return nll.detach(), leaf.grad


def test_fp32_loss_and_gradient_equal_the_dense_formula(world_of_one):
    """Each entry to 1e-5 relative: a confident target's loss and gradient (~1e-6) too, which
    log(sum of exp) in fp32 gets 8% wrong."""
    logits, targets, weights = make_case()
    nll, grad = loss_and_grad(logits, targets, weights)
    ref, ref_grad = dense_loss_and_grad(logits, targets, weights)
    assert nll.dtype == torch.float32 and torch.isfinite(nll).all()
    assert torch.allclose(nll.double(), ref, rtol=1e-6, atol=0)
    assert ((grad.double() - ref_grad).abs() <= 1e-5 * ref_grad.abs()).all()  # each entry, the targets' too
    assert (grad[..., MASK:] == 0).all()  # [MASK] and padding


@pytest.mark.parametrize("chunk_rows", [None, 5, 1])  # None: CHUNK_ELEMENTS (one chunk here)
def test_bf16_loss_is_fp32_inside_and_its_gradient_rounds_once_or_twice(chunk_rows, world_of_one, monkeypatch):
    """bf16 logits: the loss is the fp32 loss of the same (rounded) values; every gradient entry,
    the confident targets' small ones included, is the dense value within two bf16 roundings."""
    if chunk_rows is not None:
        monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", chunk_rows * PADDED)
    logits, targets, weights = make_case()
    nll, grad = loss_and_grad(logits, targets, weights, torch.bfloat16)
    rounded = logits.bfloat16().float()
    assert grad.dtype == torch.bfloat16
    assert torch.allclose(nll, loss_and_grad(rounded, targets, weights)[0], rtol=1e-6, atol=1e-6)
    _, ref_grad = dense_loss_and_grad(rounded, targets, weights)
    assert ((grad.double() - ref_grad).abs() <= 2 ** -7 * ref_grad.abs()).all()
    assert (grad[..., MASK:] == 0).all()


def assert_gradient_in_logits_storage(loss_fn, logits: torch.Tensor) -> None:
    """The gradient of loss_fn(output).sum() that reaches the model's output (a tracked copy of
    `logits`) is that output's own storage, and autograd saved nothing else of its size."""
    out = logits.detach().requires_grad_().clone()
    saved = []

    def pack(tensor):
        saved.append((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(out)
    grad, = torch.autograd.grad(loss.sum(), out)
    storage = out.untyped_storage()
    assert grad.untyped_storage().data_ptr() == storage.data_ptr()
    large = [ptr for ptr, nbytes in saved if nbytes >= storage.nbytes() // 4]
    assert large and all(ptr == storage.data_ptr() for ptr in large)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_lives_in_the_logits_storage(dtype, world_of_one, monkeypatch):
    """What the output layer's backward receives is the logits' own storage (megatron-core's cross
    entropy saves an fp32 softmax and returns a new gradient: three bf16 logits' worth)."""
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", 4 * PADDED)
    logits, targets, weights = make_case()
    assert_gradient_in_logits_storage(
        lambda out: vocab_parallel.cross_entropy(out, targets, MASK, VOCAB) * weights, logits.to(dtype))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_heads_on_two_vocabulary_shards_equal_dense_references(tmp_path):
    """TP=2 over gloo: the cross entropy (fp32 and bf16) and Duo's NELBO on the two shards of full
    logits; [MASK] and the padding are on the second shard, the first has no excluded column. Also
    the cross entropy with the vocabulary padded so far that the second shard holds no real id."""
    result = run_worker_on_two_ranks("vocab_parallel_worker.py", tmp_path, timeout=180)
    for case, r in result.items():
        assert r["loss_rel_err"] <= (2e-6 if case.startswith("ce") else 1e-5), (case, r)
        assert r["grad_within"] and r["excluded_grad_zero"] and r["ranks_agree"], (case, r)
