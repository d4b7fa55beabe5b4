"""torchrun worker: several runs of a few training iterations from fully random weights, one after
another in the same processes, each run's metrics to a JSON file of its own.

    parallel_worker.py OUT_DIR CASES_JSON

CASES_JSON maps a case name to its pretrain_dllm.py flags. Each case builds the run exactly as
pretrain_dllm.py does (Trainer: it re-initialises megatron's model-parallel state for its own
layout), then re-draws every weight — adaLN and output layer included — from the
layout-independent initialiser, so the gradients of every parameter are non-trivial from the
first step. One launch for many layouts saves a process start, the torch and megatron imports and
torchrun's rendezvous per layout. A case that fails ends the launch with its traceback; the cases
before it have written their results.
"""
import gc
import json
import os
import sys

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dllm import platform
from megatron_dllm.config import parse_args
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.training.trainer import Trainer


def noise_fingerprints(trainer) -> list:
    """(dp rank, z_t, sigma, t) of the first iteration's micro-batches, from every rank."""
    inputs = list(trainer.train_batches.iteration(consumed=0))
    mine = (parallel_state.get_data_parallel_rank(),
            [(i.input_ids.tolist(), i.sigma.tolist(), i.t.tolist()) for i in inputs])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def run_case(argv: list[str]) -> dict:
    trainer = Trainer(parse_args(argv))
    prints = noise_fingerprints(trainer)
    same_noise = all(a[1] == b[1] for a in prints for b in prints if a[0] == b[0])
    for chunk in trainer.model:
        initialize_weights(chunk.module, seed=7, adaln_zero=False)
    records = [trainer.train_step() for _ in range(trainer.config.training.train_iters)]
    valid = trainer.evaluate()
    trainer.logger.close()
    return {"loss": [r[0] for r in records], "grad_norm": [r[1] for r in records], "valid": valid,
            "same_noise_in_dp_group": same_noise}


def main():
    out_dir, cases_file = sys.argv[1], sys.argv[2]
    with open(cases_file) as f:
        cases = json.load(f)
    for name, argv in cases.items():
        result = run_case(argv)
        if dist.get_rank() == dist.get_world_size() - 1:  # the last pipeline stage holds the losses
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(result, f)
        gc.collect()
        dist.barrier()
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
