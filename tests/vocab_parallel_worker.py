"""torchrun worker (2 gloo ranks, TP=2): the vocab-parallel heads on the two vocabulary shards of
full logits against their dense references (tests/test_duo.py, tests/test_vocab_parallel.py):
Duo's NELBO and the cross entropy in fp32 and bf16, eager and with their chunk bodies compiled (the
first shard excludes no column, the second [MASK] and the padding). Max errors to a JSON file
(last rank)."""
import sys

import test_duo
import test_vocab_parallel as ce
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from rank_results import write_worst

from megatron_dllm import platform
from megatron_dllm.families import vocab_parallel

PADDED, VOCAB, MASK = ce.PADDED, ce.VOCAB, ce.MASK
assert (PADDED, VOCAB, MASK) == (test_duo.PADDED, test_duo.VOCAB, test_duo.MASK)


def on_shard(logits, lo, hi, dtype=torch.float32):
    """A leaf holding this rank's columns lo:hi of the logits, in `dtype`."""
    return logits[..., lo:hi].detach().to(dtype, copy=True).requires_grad_()


def backward(loss, weight, leaf):
    """(the loss [b, s], the leaf's gradient of (loss * weight).sum(), whether both ranks' losses agree)."""
    (loss * weight).sum().backward()
    gathered = [torch.empty_like(loss) for _ in range(2)]
    dist.all_gather(gathered, loss.detach().contiguous())
    return loss.detach().double(), leaf.grad.double(), bool(torch.equal(gathered[0], gathered[1]))


def errors(loss, grad, ref, lo, hi, agree, grad_within):
    """The case's worst loss error and its checks (`grad_within`: the gradient's, done by the caller)."""
    excluded = [j - lo for j in range(lo, hi) if j >= VOCAB or j == MASK]
    return {
        "loss_rel_err": ((loss - ref).abs() / (ref.abs() + ref.abs().mean())).max().item(),
        "grad_within": bool(grad_within),
        "excluded_grad_zero": bool((grad[..., excluded] == 0).all()) if excluded else True,
        "ranks_agree": agree,
    }


def main():
    platform.init_distributed(2, 1, seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    width = PADDED // 2
    lo, hi = rank * width, (rank + 1) * width
    results = {}
    for t_value, compiled in ((1e-3, False), (0.5, False), (1.0, False), (0.5, True)):
        family, inp, logits = test_duo.make_case(t_value)
        ref, ref_grad = test_duo.dense_loss_and_grad(inp, logits)
        leaf = on_shard(logits, lo, hi)
        with vocab_parallel.compiled_heads(compiled):
            loss = family.loss(leaf.clone(), inp)
        loss, grad, agree = backward(loss, 1.0, leaf)
        within = (grad - ref_grad[..., lo:hi]).abs().max() <= 1e-5 * ref_grad.abs().max()
        results[f"duo t={t_value}{', compiled' if compiled else ''}"] = errors(loss, grad, ref, lo, hi, agree, within)
    logits, targets, weights = ce.make_case()
    wide = torch.cat([logits, torch.randn_like(logits)], dim=-1)  # padded to 128: the second shard holds no real id
    for name, dtype, full, compiled in (("fp32", torch.float32, logits, False),
                                        ("bf16", torch.bfloat16, logits, False),
                                        ("bf16, compiled", torch.bfloat16, logits, True),
                                        ("fp32, a shard of padding only", torch.float32, wide, False)):
        width = full.shape[-1] // 2
        lo, hi = rank * width, (rank + 1) * width
        values = full.to(dtype).double()
        ref, ref_grad = ce.dense_loss_and_grad(values, targets, weights)
        leaf = on_shard(values, lo, hi, dtype)
        with vocab_parallel.compiled_heads(compiled):
            loss = vocab_parallel.cross_entropy(leaf.clone(), targets, MASK, VOCAB)
        loss, grad, agree = backward(loss, weights, leaf)
        rel = 1e-5 if dtype == torch.float32 else 2 ** -7  # each entry; bf16: two roundings
        within = ((grad - ref_grad[..., lo:hi]).abs() <= rel * ref_grad[..., lo:hi].abs()).all()
        results[f"ce {name}"] = errors(loss, grad, ref, lo, hi, agree, within)
    write_worst(results, sys.argv[1])
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
