"""The training loop: one run of a resolved RunConfig.

    data -> BatchSchedule (family.corrupt) -> DiTModel -> family.loss -> forward_backward_func
         -> optimizer.step -> scheduler.step -> log / evaluate / save

Building is `build.py`, the step `step.py` (shared with the benchmarks), checkpoints
`checkpointer.py`, rates and timers `throughput.py`; the Trainer holds the run's state and loop.
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dllm import platform
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.config import RunConfig
from megatron_dllm.config.yaml_config import resolved_dict
from megatron_dllm.errors import InputError
from megatron_dllm.training import nan_guard, observability, step
from megatron_dllm.training.build import build_batches, build_family, build_training_model
from megatron_dllm.training.checkpointer import Checkpointer, claim_save_dir, write_resolved_config
from megatron_dllm.training.ema import EMA
from megatron_dllm.training.exit_conditions import ExitConditions
from megatron_dllm.training.inputs import check_flags, prepare_inputs
from megatron_dllm.training.logger import Logger
from megatron_dllm.training.throughput import ThroughputMeter


class Trainer:
    """One training run of a resolved RunConfig: model, optimizer, batches, checkpoints, logs."""

    def __init__(self, config: RunConfig):
        config = check_flags(config)  # every rule against this launch, before any work
        parallel = config.parallel
        platform.init_distributed(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                  parallel.virtual_pipeline_model_parallel_size, seed=config.training.seed)
        config, inputs = prepare_inputs(config)  # demo corpus, tokenizer, iterations (validated again), datasets
        if inputs.train_dataset is None:
            raise InputError(f"--split {config.data.split}: the train split has weight 0, so there is nothing to "
                             f"train on")
        training, logging = config.training, config.logging
        self.config, self.tokenizer = config, inputs.tokenizer
        claim_save_dir(config.checkpoint)
        # its files fail now, not after the build
        self.logger = Logger(logging.tensorboard_dir, logging.metrics_file, self._wandb_dir(), config.checkpoint.save)
        self.family = build_family(config, self.tokenizer)
        self.meter = ThroughputMeter(config, self.tokenizer.vocab_size, dist.get_world_size())
        built = build_training_model(config, self.family, self.tokenizer.vocab_size, self.meter.timers)
        self.arch, self.transformer_config, self.layer_impl = built.arch, built.transformer_config, built.layer_impl
        self.model, self.optimizer, self.scheduler = built.model, built.optimizer, built.scheduler
        self.graph = built.graph
        self.train_batches, self.valid_batches = build_batches(config, self.family, inputs,
                                                               self.transformer_config.sequence_parallel)
        if self.meter.peak_flops or platform.HAS_CUDA:  # a CPU has no peak: no MFU line at all
            self.logger.info(f"MFU against {self.meter.peak_source}")
        self.exits = ExitConditions(training)
        self.nonfinite = nan_guard.NonFiniteCounter(training.max_consecutive_nonfinite_iters)
        self.spikes = nan_guard.LossSpikes(training.loss_spike_factor)
        self.profiler = observability.Profiler(logging)
        write_resolved_config(config, logging.tensorboard_dir, self.logger)  # beside the logs now
        self._add_wandb()
        self.ema = EMA(self.model, training.ema_decay) if training.ema_decay is not None else None
        self.checkpointer = Checkpointer(config, self.model, self.optimizer, self.scheduler, self.ema,
                                         self.identity(), self.train_batches, self.logger)
        self.iteration, self.consumed_samples = self.checkpointer.load()

    def identity(self) -> ModelIdentity:
        """What a checkpoint must match to be loaded into this run."""
        return ModelIdentity.of(self.family, self.arch)

    def _wandb_dir(self) -> str | None:
        logging = self.config.logging
        if not logging.wandb_project:
            return None
        return logging.wandb_save_dir or os.path.join(self.config.checkpoint.save or logging.tensorboard_dir or ".",
                                                      "wandb")

    def _add_wandb(self) -> None:
        if not self.config.logging.wandb_project:
            return
        if importlib.util.find_spec("wandb") is None:  # checked on every rank: none waits for another
            raise InputError("--wandb-project needs the wandb package (pip install -e '.[wandb]')")
        if self.logger.active:
            self.logger.add_writer(observability.WandbWriter(self.config.logging, resolved_dict(self.config),
                                                             self._wandb_dir()))

    # ------------------------------------------------------------------ steps

    def train_step(self) -> tuple[float | None, float | None]:
        """One iteration (the shared step); (loss, grad norm), None for a skipped step's norm."""
        captures = self.graph.captures if self.graph is not None else 0
        loss, grad_norm = step.train_step(self.model, self.optimizer, self.scheduler, self.family,
                                          self.train_batches, self.consumed_samples, self.config,
                                          self.meter.timers, self.ema, iteration=self.iteration + 1,
                                          graph=self.graph)
        self.iteration += 1  # a skipped batch is consumed too; weights and optimizer stay as they were
        if self.graph is not None and self.graph.captures > captures:
            self.logger.info(f"iteration {self.iteration}: forward and backward captured as a CUDA graph, "
                             f"replayed from now on")
        self.consumed_samples += self.config.training.global_batch_size
        if self.config.training.check_for_nan_in_loss_and_grad:
            self._count_nonfinite(grad_norm is not None)
        return loss, grad_norm

    def _count_nonfinite(self, finite: bool) -> None:
        """--check-for-nan-in-loss-and-grad: a skipped iteration is logged, and K in a row stop
        the run after a save of the last good state."""
        stop = self.nonfinite.record(finite)
        if not finite:
            self.logger.info(f"iteration {self.iteration}: non-finite loss or gradient; step skipped "
                             f"({self.nonfinite.consecutive} in a row, {self.nonfinite.skipped} in this run)")
        if stop:
            self.checkpointer.finish(self.iteration, self.consumed_samples)
            self.profiler.stop()
            self.logger.close()
            kept = (f"the last good weights and optimizer state are saved at iteration {self.iteration}"
                    if self.config.checkpoint.save else "nothing saved (no --save)")
            raise nan_guard.NonFiniteStop(
                f"{self.nonfinite.consecutive} consecutive iterations with a non-finite loss or gradient "
                f"(up to iteration {self.iteration}, --max-consecutive-nonfinite-iters "
                f"{self.config.training.max_consecutive_nonfinite_iters}); {kept}")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation NELBO per token (exact NLL for AR) over --eval-iters global batches: summed
        over all their tokens, then divided (their token counts differ under --sft)."""
        for chunk in self.model:
            chunk.eval()
        gbs = self.config.training.global_batch_size
        sums = [step.loss_sums(self.model, self.family, self.valid_batches, i * gbs, self.config,
                               self.meter.timers, training=False)
                for i in range(self.config.logging.eval_iters)]
        if sums[0] is None:
            return None
        total, count = sum(sums).tolist()
        return total / count

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        config, training, logging = self.config, self.config.training, self.config.logging
        tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
        iters = training.train_iters
        self.logger.info(f"family {self.family.name} (loss {self.family.loss_type}) | preset {config.model.preset} | "
                         f"vocab {self.arch.vocab_size} (padded {self.arch.padded_vocab_size(tp)}) | "
                         f"TP {tp} PP {pp} DP {parallel_state.get_data_parallel_world_size()} | "
                         f"device {platform.device()} | layers {self.layer_impl} | "
                         f"{iters} iterations of {training.global_batch_size} x {config.model.seq_length} tokens | "
                         f"{self.meter.cumulative_flops(iters * training.global_batch_size):.4g} training FLOPs "
                         f"({training.flops_convention})")
        self.checkpointer.check_disk(self.iteration, self.transformer_config.bf16)
        if self.iteration >= iters:  # loaded a checkpoint at (or past) the end: evaluate only
            evaluates = self.valid_batches.dataset is not None  # built for --eval-interval
            self.logger.info(f"iteration {self.iteration} already reaches --train-iters {iters}: "
                             + ("evaluating only" if evaluates else "nothing to do (no --eval-interval)"))
            if evaluates:
                self.logger.resumed_at(self.iteration, validating_only=True)  # a killed attempt's record of it
                self._validate()
            self.profiler.stop()  # says that no trace was written, if --profile asked for one
            self.logger.close()
            return
        self.logger.resumed_at(self.iteration)  # it trains those iterations again
        self.meter.start(self.iteration)
        # since the last log line, as Megatron-LM's: the losses of the iterations that stepped (a NaN
        # too: a run diverging without the guard shows it), whose mean is logged, and the skipped ones
        interval_losses, skipped = [], 0

        def log_line(loss, grad_norm):
            nonlocal interval_losses, skipped
            report = self.meter.measure(self.iteration)
            if loss is not None:  # NaN when every iteration of the interval was skipped
                loss = sum(interval_losses) / len(interval_losses) if interval_losses else float("nan")
            text, extra = report.text, report.extra
            if skipped:
                text += f" | skipped iterations {skipped}"
                extra = {**(extra or {}), "skipped_iterations": skipped}
            interval_losses, skipped = [], 0
            self.logger.train(self.iteration, iters, loss, self.optimizer.param_groups[0]["lr"], grad_norm,
                              report.rates.tokens_per_s, report.rates.tflops, self.consumed_samples,
                              self.meter.cumulative_flops(self.consumed_samples), extra_text=text,
                              extra=extra, scalars=report.scalars)

        while self.iteration < iters:
            self.profiler.before_iteration(self.iteration + 1)
            self.checkpointer.poll()
            loss, grad_norm = self.train_step()
            if grad_norm is None:
                skipped += 1
            elif loss is not None:  # the last pipeline stage's
                interval_losses.append(loss)
            if (mean := self.spikes.check(loss)) is not None:
                self.logger.info(f"loss spike at iteration {self.iteration}: {loss:.4f} is over "
                                 f"{training.loss_spike_factor:g} x the recent mean {mean:.4f}")
            if self.iteration % logging.log_interval == 0 or self.iteration == iters:
                log_line(loss, grad_norm)
            if logging.eval_interval and (self.iteration % logging.eval_interval == 0 or self.iteration == iters):
                with self.meter.paused(discard_phase_times=True):  # validation's schedule is not training's
                    self._validate()
            self.checkpointer.after_iteration(self.iteration, self.consumed_samples, paused=self.meter.paused)
            reason = self.exits.reason(self.iteration)
            if reason is not None:
                if self.iteration != self.meter.last:  # the iterations since the last line: not lost at a resume
                    log_line(loss, grad_norm)
                self.logger.info(f"exiting after iteration {self.iteration}: {reason}")
                break
        self.profiler.stop()
        self.checkpointer.finish(self.iteration, self.consumed_samples)
        self.logger.close()

    def _validate(self) -> None:
        self.logger.valid(self.iteration, self.evaluate(), self.meter.cumulative_flops(self.consumed_samples),
                          self.consumed_samples)
