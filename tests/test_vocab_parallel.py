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


def loss_and_grad(logits, targets, weights, dtype=torch.float32, compiled=False):
    leaf = logits.detach().to(dtype, copy=True).requires_grad_()
    with vocab_parallel.compiled_heads(compiled):  # the backward below runs after it closed, as in training
        nll = vocab_parallel.cross_entropy(leaf.clone(), targets, MASK, VOCAB)
    (nll * weights).sum().backward()
    return nll.detach(), leaf.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_loss_and_gradient_equal_the_dense_formula(compiled, world_of_one):
    """Each entry to 1e-5 relative: a confident target's loss and gradient (~1e-6) too, which
    log(sum of exp) in fp32 gets 8% wrong. Also with the chunk body compiled."""
    logits, targets, weights = make_case()
    nll, grad = loss_and_grad(logits, targets, weights, compiled=compiled)
    ref, ref_grad = dense_loss_and_grad(logits, targets, weights)
    assert nll.dtype == torch.float32 and torch.isfinite(nll).all()
    assert torch.allclose(nll.double(), ref, rtol=1e-6, atol=0)
    assert ((grad.double() - ref_grad).abs() <= 1e-5 * ref_grad.abs()).all()  # each entry, the targets' too
    assert (grad[..., MASK:] == 0).all()  # [MASK] and padding


@pytest.mark.parametrize("chunk_rows, compiled", [(None, False), (5, False), (1, False), (5, True)],
                         ids=["eager", "eager-chunks-of-5", "eager-chunks-of-1", "compiled"])
def test_bf16_loss_is_fp32_inside_and_its_gradient_rounds_once_or_twice(chunk_rows, compiled, world_of_one,
                                                                         monkeypatch):
    """bf16 logits: the loss is the fp32 loss of the same (rounded) values; every gradient entry,
    the confident targets' small ones included, is the dense value within two bf16 roundings.
    Also in chunks of 5 and 1 rows (None: one chunk here), and compiled (all rows at once)."""
    if chunk_rows is not None:
        monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", chunk_rows * PADDED)
    logits, targets, weights = make_case()
    nll, grad = loss_and_grad(logits, targets, weights, torch.bfloat16, compiled)
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


def test_eager_fp32_makes_no_tensor_beyond_a_few_per_row_values(world_of_one):
    """Eagerly, fp32 logits are worked on in place: besides the logits' own storage, forward and
    backward make no tensor of more than a few values per row (a mask over the logits, as the
    compiled body's comparison, would be a pass over them to write and one to read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestNew(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() != storage:
                    self.largest = max(self.largest, t.numel())
            return out

    logits, targets, weights = make_case()
    out = logits.detach().requires_grad_().clone()  # the model's output
    storage = out.untyped_storage().data_ptr()
    rows = logits.shape[0] * logits.shape[1]
    with LargestNew() as seen:
        loss = vocab_parallel.cross_entropy(out, targets, MASK, VOCAB)
        torch.autograd.grad((loss * weights).sum(), out)
    assert seen.largest <= 2 * rows, seen.largest


@pytest.mark.slow
@pytest.mark.multiprocess
def test_heads_on_two_vocabulary_shards_equal_dense_references(tmp_path):
    """TP=2 over gloo: the cross entropy (fp32 and bf16) and Duo's NELBO on the two shards of full
    logits, eager and compiled; [MASK] and the padding are on the second shard, the first has no
    excluded column. Also the cross entropy with the vocabulary padded so far that the second
    shard holds no real id."""
    result = run_worker_on_two_ranks("vocab_parallel_worker.py", tmp_path, timeout=180)
    for case, r in result.items():
        assert r["loss_rel_err"] <= (2e-6 if case.startswith("ce") else 1e-5), (case, r)
        assert r["grad_within"] and r["excluded_grad_zero"] and r["ranks_agree"], (case, r)


def test_compiled_heads_take_every_length_with_one_graph_each(world_of_one):
    """A compiled chunk body meets many row counts: micro-batches of `--variable-seq-length-prob`'s
    lengths. Each body is one graph for all of them: compiled per shape, the ninth would stop the
    run (fullgraph=True turns dynamo's recompile limit into an error). The shards of tensor
    parallelism (other widths and excluded columns, each in a process of its own in a run) add at
    most one graph each where dynamo had taken two equal sizes for one (duck sizing)."""
    from torch._dynamo.utils import counters

    from megatron_dllm.families import get_family
    from megatron_dllm.families.base import ModelInput

    torch._dynamo.reset()  # the compiles of this process's earlier tests do not count
    counters.clear()
    duo = get_family("duo", MASK, VOCAB)
    gen = torch.Generator().manual_seed(0)
    for shard, (width, mask) in enumerate(((64, 49), (72, 60), (80, 33))):  # [MASK] elsewhere too
        for length in range(3, 15, 3):  # never 2, the batch size: dynamo would take them for one size
            logits = torch.randn(length, 2, width, generator=gen, dtype=torch.bfloat16)
            targets = torch.randint(0, mask, (2, length), generator=gen)
            inp = ModelInput(input_ids=targets, position_ids=None, sigma=None, targets=targets,
                             valid=torch.ones(2, length), t=torch.rand(2))
            for head, args in ((vocab_parallel.cross_entropy, (targets, mask, VOCAB)), (duo.nelbo, (inp,))):
                with vocab_parallel.compiled_heads():
                    loss = head(logits.clone().requires_grad_(), *args)
                loss.sum().backward()
        # the cross entropy's body and Duo's four (per length, 5 x 4 by now)
        assert counters["stats"]["unique_graphs"] <= 5 * (1 + shard), (shard, counters["stats"])
        if shard == 0:
            assert counters["stats"]["unique_graphs"] == 5, counters["stats"]


def _bodies():
    """Each chunk body of the heads with the arguments of a chunk of 12 rows of bf16 logits, [MASK]
    and the padding excluded; each writes its results into the tensors it is given."""
    from megatron_dllm.families import duo

    gen = torch.Generator().manual_seed(0)
    rows, excluded = 12, [(MASK, VOCAB), (VOCAB, PADDED)]
    logits = torch.randn(rows, PADDED, generator=gen).bfloat16()
    per_row = [torch.randn(rows, generator=gen) for _ in range(3)]
    index, owned = torch.randint(0, MASK, (rows, 1), generator=gen), torch.rand(rows, generator=gen) < 0.5
    out = torch.zeros(rows), torch.zeros(rows, dtype=torch.float64), torch.zeros(2, rows, dtype=torch.float64)
    dropped = vocab_parallel.column_mask(PADDED, excluded, "cpu")  # as the compiled cross entropy takes them
    return {"ce bf16": (vocab_parallel._exp_sum_masked_, (out[0], logits, per_row[0], index, owned, dropped)),
            "ce fp32": (vocab_parallel._exp_sum_masked_, (out[0], logits.float(), per_row[0], index, owned, dropped)),
            "duo max": (duo._row_max_, (out[0], logits, excluded)),
            "duo sum-exp": (duo._row_sum_exp_, (out[1], logits, per_row[0], excluded)),
            "duo S1, W2": (duo._row_s1_w2_, (out[2], logits, per_row[0], excluded)),
            "duo gradient": (duo._grad_rows_, (logits, *per_row, excluded))}


@pytest.mark.parametrize("body", list(_bodies()))
def test_a_compiled_chunk_body_is_one_kernel_that_allocates_no_chunk(body):
    """Compiled, each chunk body is one fused pass over its rows (eagerly, up to ten) that allocates
    per-row buffers at most: the fp32 copy of the chunk and its temporaries stay in registers, and
    a gradient or exp() goes straight to the logits' storage. Read from TorchInductor's generated
    code (its CPU kernels; a GPU's Triton kernels follow the same fusion plan)."""
    import re

    from torch._inductor.utils import run_and_get_code

    fn, args = _bodies()[body]
    eager_args = [a.clone() if torch.is_tensor(a) else a for a in args]
    fn(*eager_args)
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=True), *args)
    for got, expected in zip(args, eager_args):
        if torch.is_tensor(got):
            torch.testing.assert_close(got, expected, rtol=1e-5 if got.dtype != torch.bfloat16 else None,
                                       atol=1e-6 if got.dtype != torch.bfloat16 else None)
    call = "\n".join(code.split("def call(", 1)[1].split("\ndef ", 1)[0] for code in codes)
    kernels = re.findall(r"\b(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+)\(", call)
    allocations = re.findall(r"empty_strided_\w+\(\(([^)]*)\)", call)
    assert len(kernels) == 1, kernels
    assert all(len([d for d in shape.split(",") if d.strip()]) == 1 for shape in allocations), allocations


@pytest.mark.gpu
def test_compiled_heads_on_the_gpu_equal_the_eager_ones(world_of_one):
    """TorchInductor's Triton kernels for the heads (bf16 logits on CUDA, as the GPU's training
    step runs them) give the eager heads' losses and logits gradients: the cross entropy and
    Duo's NELBO, over 2 x 384 rows of a 4,096-wide shard with [MASK] and padding excluded."""
    from megatron_dllm.families import get_family
    from megatron_dllm.families.base import ModelInput

    vocab, mask, width, b, s = 4000, 3999, 4096, 2, 384
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(s, b, width, generator=gen)).bfloat16().cuda()
    targets = torch.randint(0, mask, (b, s), generator=gen).cuda()
    duo = get_family("duo", mask, vocab)
    inp = ModelInput(input_ids=targets.roll(1, 1), position_ids=None, sigma=None, targets=targets,
                     valid=torch.ones(b, s, device="cuda"), t=torch.rand(b, generator=gen).cuda())
    for head, args in ((vocab_parallel.cross_entropy, (targets, mask, vocab)), (duo.nelbo, (inp,))):
        results = []
        for compiled in (False, True):
            out = logits.clone().requires_grad_()
            with vocab_parallel.compiled_heads(compiled):
                loss = head(out.clone(), *args)
            loss.sum().backward()
            results.append((loss.detach(), out.grad))
        (loss, grad), (compiled_loss, compiled_grad) = results
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled_grad, grad)  # bf16: within its rounding
