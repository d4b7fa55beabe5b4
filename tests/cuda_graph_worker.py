"""torchrun worker (2 gloo ranks, data parallel): tests/step_cases.py's training with the
stand-in graph against the eager step, each rank on samples of its own; whether every rank's
losses and weights equal its eager run's and whether the ranks' weights agree, as JSON (last rank)."""
import json
import sys

import torch
import torch.distributed as dist
from step_cases import GRAPH, train

from megatron_dllm import platform


def main():
    platform.init_distributed(1, 1, seed=0)
    rank = dist.get_rank()
    eager_losses, _, eager_weights, _ = train("mdlm", 4, first=1000 * rank)
    losses, _, weights, built = train("mdlm", 4, *GRAPH, "--cuda-graph-warmup-steps", "1", first=1000 * rank)
    flat = torch.cat([w.flatten() for w in weights])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    mine = {"losses_equal": losses == eager_losses,
            "weights_equal": all(torch.equal(a, b) for a, b in zip(weights, eager_weights)),
            "ranks_agree": torch.equal(gathered[0], gathered[1]), "captures": built.graph.captures}
    every = [None, None]
    dist.all_gather_object(every, mine)
    if rank == 1:
        with open(sys.argv[1], "w") as f:
            json.dump({k: (all(r[k] for r in every) if isinstance(v, bool) else max(r[k] for r in every))
                       for k, v in mine.items()}, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
