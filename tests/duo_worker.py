"""torchrun worker (2 gloo ranks, TP=2): the Duo loss on the two vocabulary shards of full logits
against the dense reference in tests/test_duo.py; max errors to a JSON file (last rank)."""
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from rank_results import write_worst
from test_duo import MASK, PADDED, VOCAB, dense_loss_and_grad, make_case

from megatron_dllm import platform


def main():
    platform.init_distributed(2, 1, seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    width = PADDED // 2
    lo, hi = rank * width, (rank + 1) * width
    results = {}
    for t_value in (1e-3, 0.5, 1.0):
        family, inp, logits = make_case(t_value)
        ref, ref_grad = dense_loss_and_grad(inp, logits)
        leaf = logits[..., lo:hi].clone().requires_grad_()
        loss = family.loss(leaf.clone(), inp)
        loss.sum().backward()
        gathered = [torch.empty_like(loss) for _ in range(2)]
        dist.all_gather(gathered, loss.detach().contiguous())
        grad = leaf.grad.double()
        suppressed = [j - lo for j in range(lo, hi) if j >= VOCAB or j == MASK]
        results[str(t_value)] = {
            "loss_rel_err": ((loss.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item(),
            "grad_err": (grad - ref_grad[..., lo:hi]).abs().max().item(),
            "grad_scale": ref_grad.abs().max().item(),
            "suppressed_grad_zero": bool((grad[..., suppressed] == 0).all()) if suppressed else True,
            "ranks_agree": bool(torch.equal(gathered[0], gathered[1])),
        }
    write_worst(results, sys.argv[1])
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
