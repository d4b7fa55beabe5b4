"""torchrun worker (2 gloo ranks): the decisions every rank must take together, each raised on one
rank only. A SIGUSR1 delivered to rank 1 stops both ranks after the same iteration
(--exit-signal-handler); a NaN loss, known on the last pipeline stage alone, skips the step on
both (--check-for-nan-in-loss-and-grad); `platform.any_rank` ORs each flag over the ranks. Writes
each rank's answers as JSON (last rank)."""
import json
import os
import signal
import sys

import torch.distributed as dist

from megatron_dllm import platform
from megatron_dllm.config.training import TrainingConfig
from megatron_dllm.training import nan_guard
from megatron_dllm.training.exit_conditions import ExitConditions


class FiniteGradients:
    """The two calls of megatron-core's optimizer that `finite_grad_norm` makes: no inf, norm 2."""

    def prepare_grads(self):
        return False

    def get_grad_norm(self):
        return 2.0


def main():
    platform.init_distributed(seed=0)
    rank = dist.get_rank()
    exits = ExitConditions(TrainingConfig(exit_signal_handler=True))
    before = exits.reason(4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    mine = {
        "before_signal": before,
        "after_signal": exits.reason(5),
        "any_rank": platform.any_rank([rank == 1, rank == 0, False]),
        "finite_norm": nan_guard.finite_grad_norm(FiniteGradients(), None if rank == 0 else 1.5),
        "nan_loss_norm": nan_guard.finite_grad_norm(FiniteGradients(), None if rank == 0 else float("nan")),
    }
    every = [None, None]
    dist.all_gather_object(every, mine)
    if rank == 1:
        with open(sys.argv[1], "w") as f:
            json.dump(every, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
