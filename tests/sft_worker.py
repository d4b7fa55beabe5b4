"""torchrun worker (2 gloo ranks, TP=2): every family's SFT loss on the two vocabulary shards of
full logits against the dense reference in tests/sft_cases.py; results to a JSON file (rank 1)."""
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from rank_results import write_worst
from sft_cases import PADDED, dense_sft_loss, make_case

from megatron_dllm import platform


def main():
    platform.init_distributed(2, 1, seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    lo, hi = rank * PADDED // 2, (rank + 1) * PADDED // 2
    results = {}
    for name in ("ar", "mdlm", "duo", "esolm"):
        family, tokens, prompt, inp, logits = make_case(name, seed=2)
        ref = dense_sft_loss(name, tokens, prompt, inp, logits)
        leaf = logits[..., lo:hi].clone().requires_grad_()
        per_token = family.loss(leaf.clone(), inp)
        loss = per_token.sum() / inp.valid.sum()
        loss.backward()
        gathered = [torch.empty_like(per_token) for _ in range(2)]
        dist.all_gather(gathered, per_token.detach().contiguous())
        # no gradient reaches the logits of prompt positions (the loss never looks at them)
        no_loss = (inp.valid == 0).t()  # [s, b]
        results[name] = {"rel_err": abs(loss.item() - ref.item()) / abs(ref.item()),
                         "ranks_agree": bool(torch.equal(gathered[0], gathered[1])),
                         "prompt_grad_zero": bool(leaf.grad[no_loss].eq(0).all())}
    write_worst(results, sys.argv[1])
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
