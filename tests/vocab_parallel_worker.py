"""torchrun worker (2 gloo ranks, TP=2): the vocab-parallel heads on the two vocabulary shards of
full logits against their dense references (tests/test_duo.py, tests/test_vocab_parallel.py):
Duo's NELBO and the cross entropy in fp32 and bf16. Max errors to a JSON file (last rank)."""
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


def on_shard(loss_fn, logits, lo, hi, dtype=torch.float32):
    """(the loss on columns lo:hi [b, s], its gradient there, whether both ranks' losses agree)."""
    leaf = logits[..., lo:hi].detach().to(dtype, copy=True).requires_grad_()
    loss, weight = loss_fn(leaf.clone())
    (loss * weight).sum().backward()
    gathered = [torch.empty_like(loss) for _ in range(2)]
    dist.all_gather(gathered, loss.detach().contiguous())
    return loss.detach().double(), leaf.grad.double(), bool(torch.equal(gathered[0], gathered[1]))


def errors(loss, grad, ref, ref_grad, lo, hi, agree, grad_within):
    """The case's worst loss error and its checks; `grad_within(grad, ref_grad)` on this shard."""
    excluded = [j - lo for j in range(lo, hi) if j >= VOCAB or j == MASK]
    return {
        "loss_rel_err": ((loss - ref).abs() / (ref.abs() + ref.abs().mean())).max().item(),
        "grad_within": bool(grad_within(grad, ref_grad[..., lo:hi])),
        "excluded_grad_zero": bool((grad[..., excluded] == 0).all()) if excluded else True,
        "ranks_agree": agree,
    }


def main():
    platform.init_distributed(2, 1, seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    width = PADDED // 2
    lo, hi = rank * width, (rank + 1) * width
    results = {}
    for t_value in (1e-3, 0.5, 1.0):
        family, inp, logits = test_duo.make_case(t_value)
        ref, ref_grad = test_duo.dense_loss_and_grad(inp, logits)
        loss, grad, agree = on_shard(lambda shard: (family.loss(shard, inp), 1.0), logits, lo, hi)
        scale = ref_grad.abs().max()
        results[f"duo t={t_value}"] = errors(loss, grad, ref, ref_grad, lo, hi, agree,
                                             lambda g, r: (g - r).abs().max() <= 1e-5 * scale)
    logits, targets, weights = ce.make_case()
    for dtype in (torch.float32, torch.bfloat16):
        values = logits.to(dtype).double()
        ref, ref_grad = ce.dense_loss_and_grad(values, targets, weights)
        loss, grad, agree = on_shard(lambda shard: (vocab_parallel.cross_entropy(shard, targets, MASK, VOCAB), weights),
                                     values, lo, hi, dtype)
        rel = 1e-5 if dtype == torch.float32 else 2 ** -7  # each entry; bf16: two roundings
        results[f"ce {dtype}"] = errors(loss, grad, ref, ref_grad, lo, hi, agree,
                                        lambda g, r: ((g - r).abs() <= rel * r.abs()).all())
    write_worst(results, sys.argv[1])
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
