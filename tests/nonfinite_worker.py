"""pretrain_dllm.py with NaN gradients injected into the iterations listed in NONFINITE_ITERATIONS
(a test of --check-for-nan-in-loss-and-grad): a backward hook on the logits poisons every
gradient of those iterations while their loss stays finite. The shared step's loss function
(training.step.loss_func) is wrapped; Trainer.train_step is wrapped to tell it the iteration."""
import os
import sys

import torch

from megatron_dllm.cli import pretrain
from megatron_dllm.training import step
from megatron_dllm.training.trainer import Trainer

POISONED = {int(i) for i in os.environ["NONFINITE_ITERATIONS"].split(",")}
_loss_func, _train_step = step.loss_func, Trainer.train_step
running = {"iteration": 0}  # the iteration the trainer is running (1-based, as logged)


def _poisoned_loss_func(family, training, *args):  # args: (..., the logits)
    if training and running["iteration"] in POISONED:
        args[-1].register_hook(lambda grad: torch.full_like(grad, float("nan")))
    return _loss_func(family, training, *args)


def _counted_train_step(self):
    running["iteration"] = self.iteration + 1
    return _train_step(self)


if __name__ == "__main__":
    step.loss_func, Trainer.train_step = _poisoned_loss_func, _counted_train_step
    sys.exit(pretrain.main(sys.argv[1:]))
