"""Log lines on the last rank (which holds the losses, as in Megatron-LM) and TensorBoard."""
from __future__ import annotations

import json
import math

import torch.distributed as dist


class Logger:
    def __init__(self, tensorboard_dir: str | None, metrics_file: str | None = None):
        self.active = dist.get_rank() == dist.get_world_size() - 1
        self.writer = self.metrics = None
        if self.active and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)
        if self.active and metrics_file:
            self.metrics = open(metrics_file, "a")

    def _record(self, **values) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(values) + "\n")
            self.metrics.flush()

    def info(self, message: str) -> None:
        if self.active:
            print(message, flush=True)

    def train(self, iteration, total, loss, lr, grad_norm, tokens_per_s, tflops, consumed, flops) -> None:
        if not self.active:
            return
        line = (f" iteration {iteration:7d}/{total} | consumed samples {consumed} | lr {lr:.3e} | "
                f"loss {loss:.4f} | grad norm {grad_norm:.3f} | tokens/s {tokens_per_s:,.0f} | "
                f"TFLOP/s per device {tflops:.2f} | FLOPs {flops:.4g}")
        print(line, flush=True)
        self._record(iteration=iteration, loss=loss, lr=lr, grad_norm=grad_norm,
                     tokens_per_s=tokens_per_s, tflops_per_device=tflops, consumed_samples=consumed,
                     flops=flops)
        if self.writer:
            for name, value in (("loss", loss), ("lr", lr), ("grad-norm", grad_norm),
                                ("tokens-per-second", tokens_per_s)):
                self.writer.add_scalar(f"train/{name}", value, iteration)

    def valid(self, iteration, nelbo, flops=None) -> None:
        if not self.active or nelbo is None:
            return
        ppl = math.exp(min(nelbo, 50.0))
        print(f" validation at iteration {iteration} | nelbo {nelbo:.4f} | ppl {ppl:.3f}", flush=True)
        self._record(iteration=iteration, valid_nelbo=nelbo, valid_ppl=ppl,
                     **({} if flops is None else {"flops": flops}))
        if self.writer:
            self.writer.add_scalar("valid/nelbo", nelbo, iteration)
            self.writer.add_scalar("valid/ppl", ppl, iteration)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.metrics:
            self.metrics.close()
