"""torchrun worker: a few training iterations from fully random weights, metrics to a JSON file.

Builds the run exactly as pretrain_dllm.py does (Trainer), then re-draws every weight — adaLN
and output layer included — from the layout-independent initialiser, so the gradients of every
parameter are non-trivial from the first step.
"""
import json
import sys

import torch.distributed as dist

from megatron_dllm import platform
from megatron_dllm.arguments import parse_args
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.training.trainer import Trainer


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    trainer = Trainer(parse_args(argv))
    for chunk in trainer.model:
        initialize_weights(chunk.module, seed=7, adaln_zero=False)
    records = [trainer.train_step() for _ in range(trainer.run.train_iters)]
    valid = trainer.evaluate()
    if dist.get_rank() == dist.get_world_size() - 1:
        with open(out, "w") as f:
            json.dump({"loss": [r[0] for r in records], "grad_norm": [r[1] for r in records],
                       "valid": valid}, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
