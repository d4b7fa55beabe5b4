"""pretrain_dllm.py with NaN gradients injected into the iterations listed in NONFINITE_ITERATIONS
(a test of --check-for-nan-in-loss-and-grad): a backward hook on the logits poisons every
gradient of those iterations while their loss stays finite."""
import os
import sys

import torch

from megatron_dllm.cli import pretrain
from megatron_dllm.training.trainer import Trainer

POISONED = {int(i) for i in os.environ["NONFINITE_ITERATIONS"].split(",")}
_loss_func = Trainer._loss_func


def _poisoned_loss_func(self, training, inp, logits):
    if training and self.iteration + 1 in POISONED:
        logits.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    return _loss_func(self, training, inp, logits)


if __name__ == "__main__":
    Trainer._loss_func = _poisoned_loss_func
    sys.exit(pretrain.main(sys.argv[1:]))
