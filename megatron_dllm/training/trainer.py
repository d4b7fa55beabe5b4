"""The training loop: megatron-core's schedules, DDP and optimizer around a family and the DiT.

    data -> BatchSchedule (family.corrupt) -> DiTModel -> family.loss -> forward_backward_func
         -> optimizer.step -> scheduler.step -> log / evaluate / save
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dllm import checkpoint, platform
from megatron_dllm.checkpoint import retention, training_state
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.tokenizer_record import check_tokenizer, tokenizer_record
from megatron_dllm.config import RunConfig
from megatron_dllm.config.checkpoint import CheckpointConfig
from megatron_dllm.config.yaml_config import resolved_dict, write_resolved
from megatron_dllm.families import get_family
from megatron_dllm.model.attention import resolve_backend
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.scaling.flops import train_flops_per_sequence
from megatron_dllm.training import nan_guard, observability
from megatron_dllm.training.batches import BatchSchedule
from megatron_dllm.training.ema import EMA
from megatron_dllm.training.exit_conditions import ExitConditions
from megatron_dllm.training.inputs import prepare_inputs
from megatron_dllm.training.logger import Logger
from megatron_dllm.training.optim import build_optimizer, wrap_ddp


class Trainer:
    """One training run of a resolved RunConfig: model, optimizer, batches, checkpoints, logs."""

    def __init__(self, cfg: RunConfig):
        par = cfg.parallel
        platform.init_distributed(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                  par.virtual_pipeline_model_parallel_size, seed=cfg.training.seed)
        cfg, inputs = prepare_inputs(cfg)  # defaults, tokenizer, datasets, iterations
        self.cfg, self.tokenizer = cfg, inputs.tokenizer
        ckpt, model_cfg, prec, t = cfg.checkpoint, cfg.model, cfg.precision, cfg.training
        if ckpt.save:  # a run that cannot save fails now, not after its first save interval
            checkpoint.check_writable(ckpt.save)
            checkpoint.store.lock_save(ckpt.save)  # held until this process exits
            if not ckpt.load or ckpt.finetune:  # iteration 0 again: its saves would replace what is there
                checkpoint.store.refuse_existing(ckpt.save, ckpt.finetune)
        self.tokenizer_record = tokenizer_record(cfg.tokenizer)
        vocab = self.tokenizer.vocab_size
        self.family = get_family(model_cfg.family, self.tokenizer.mask_id, vocab, model_cfg.loss)
        preset = cfg.preset()
        self.arch = Architecture(preset, vocab, model_cfg.seq_length, self.family.attention,
                                 model_cfg.make_vocab_size_divisible_by)
        use_te = (platform.HAS_TE if model_cfg.transformer_impl is None
                  else model_cfg.transformer_impl == "transformer_engine")
        if (use_te or prec.fp8_format) and not platform.HAS_TE:
            raise ValueError("--transformer-impl transformer_engine and --fp8-format need TransformerEngine "
                             "on a CUDA GPU (not found); use --transformer-impl local without FP8")
        fusion = model_cfg.fusion(use_te)
        self.config, mlp_config = transformer_config(
            self.arch, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
            vpp=par.virtual_pipeline_model_parallel_size, sequence_parallel=par.sequence_parallel,
            bf16=prec.bf16, fp8=prec.fp8_format, fp8_recipe=prec.fp8_recipe,
            fp8_amax_history_len=prec.fp8_amax_history_len,
            fp8_amax_compute_algo=prec.fp8_amax_compute_algo, recompute=model_cfg.recompute(),
            variable_seq_lengths=cfg.data.variable_seq_length_prob > 0 and self.family.variable_length,
            fusion=fusion,
        )
        self.timers = observability.make_timers(cfg.logging.timing_log_level)
        self.config.timers = self.timers  # megatron's schedules and gradient sync time themselves
        attention = resolve_backend(model_cfg.attention_backend, use_te)
        chunks = build_model(self.arch, self.config, mlp_config, t.seed, use_te=use_te, attention_backend=attention)
        self.model = wrap_ddp(chunks, self.config, par)
        self.layer_impl = f"{'transformer_engine' if use_te else 'local'}, attention {attention}, {fusion.describe()}"
        self.optimizer, self.scheduler = build_optimizer(self.model, self.config, cfg.optimizer, par, t.train_iters)

        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        if t.global_batch_size % (t.micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {t.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp_size}")
        self.train_batches = BatchSchedule(
            inputs.train_dataset, self.family, t.seed, t.micro_batch_size, t.global_batch_size,
            dp_rank, dp_size, variable_length_prob=cfg.data.variable_seq_length_prob,
            length_multiple=par.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        # Validation draws fixed noise (its own seed stream) at full length so evaluations compare.
        self.valid_batches = BatchSchedule(inputs.valid_dataset, self.family, t.seed + 1,
                                           t.micro_batch_size, t.global_batch_size, dp_rank, dp_size)
        self.logger = Logger(cfg.logging.tensorboard_dir, cfg.logging.metrics_file)
        self._start_cluster_features()
        self.ema = EMA(self.model, t.ema_decay) if t.ema_decay is not None else None
        self.iteration, self.consumed_samples = 0, 0
        if ckpt.save:
            checkpoint.remove_incomplete(ckpt.save, log=self.logger.info)
            checkpoint.store.remove_leftover_removals(ckpt.save, log=self.logger.info)
        if ckpt.load:
            self._load(ckpt)
        # TFLOP/s counts every matmul the hardware runs; the cumulative FLOPs use the budget's convention.
        self.flops_per_seq = train_flops_per_sequence(preset, vocab, model_cfg.seq_length, "full")
        self.budget_flops_per_seq = train_flops_per_sequence(preset, vocab, model_cfg.seq_length, t.flops_convention)

    def _load(self, ckpt: CheckpointConfig) -> None:
        found = checkpoint.locate(ckpt.load, ckpt.ckpt_step, log=self.logger.info)
        if found is None:
            if ckpt.save and os.path.abspath(ckpt.load) == os.path.abspath(ckpt.save):  # the resume idiom
                self.logger.info(f"no checkpoint in {ckpt.load}: starting from iteration 0")
                return
            what = "holds no checkpoint" if os.path.isdir(ckpt.load) else "does not exist"
            raise checkpoint.CheckpointError(
                f"--load {ckpt.load} {what} (expected {checkpoint.TRACKER} or iter_XXXXXXX directories, "
                f"or a checkpoint directory itself)")
        self.logger.info(f"loading {found.path} ({found.how})")
        common = training_state.load_checkpoint(
            found.path, self.model, self.optimizer, self.scheduler, self.identity(),
            load_optim=not ckpt.no_load_optim, load_rng=not ckpt.no_load_rng, finetune=ckpt.finetune,
            ema=self.ema, log=self.logger.info)
        check_tokenizer(common.get("tokenizer"), self.cfg.tokenizer.tokenizer_model, found.path)
        if not ckpt.finetune:
            self.iteration, self.consumed_samples = common["iteration"], common["consumed_samples"]
            self.train_batches.data_offset = self._data_mix_start(common)

    def _data_mix_start(self, common: dict) -> int:
        """Where the current training mix started. Resuming with another --data-path (e.g. the
        phase-2 mix from a phase-1 checkpoint) starts the new mix at its first sample now."""
        start, mix = common.get("data_mix_start", 0), self.cfg.data.data_path
        if common.get("data_mix", mix) != mix:
            self.logger.info(f"data mix changed at iteration {self.iteration}: {common['data_mix']} -> "
                             f"{mix}; reading the new mix from its first sample")
            start = self.consumed_samples
        return start

    def identity(self) -> ModelIdentity:
        """What a checkpoint must match to be loaded into this run."""
        return ModelIdentity.of(self.family, self.arch)

    # ------------------------------------------------------------------ steps

    def _forward_step(self, training: bool, data_iterator, model):
        self.timers("batch-generator", log_level=1).start()
        inp = next(data_iterator)
        self.timers("batch-generator").stop()
        logits = model(inp.input_ids, inp.position_ids, inp.sigma)
        return logits, partial(self._loss_func, training, inp)

    def _loss_func(self, training: bool, inp, logits):
        per_token = self.family.loss(logits, inp) if training else self.family.nelbo(logits, inp)
        total, count = per_token.sum(), inp.valid.sum()
        return total, count.to(torch.int), {"loss": torch.stack([total.detach().double(), count.double()])}

    def _run_schedule(self, batches: BatchSchedule, consumed: int, training: bool) -> float | None:
        """Forward (and backward) over one global batch; returns the token-weighted mean loss on
        the last pipeline stage (None elsewhere)."""
        chunks = len(self.model)
        iterators = [batches.iteration(consumed) for _ in range(chunks)]
        losses = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, training),
            data_iterator=iterators if chunks > 1 else iterators[0],
            model=self.model if chunks > 1 else self.model[0],
            num_microbatches=batches.num_microbatches, seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size, forward_only=not training,
        )
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        summed = torch.stack([d["loss"] for d in losses]).sum(0)
        dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
        return (summed[0] / summed[1]).item()

    def train_step(self) -> tuple[float | None, float]:
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._run_schedule(self.train_batches, self.consumed_samples, training=True)
        self.timers("optimizer", log_level=1).start()
        if self.cfg.training.check_for_nan_in_loss_and_grad:
            # megatron-core's step in two halves, so a non-finite norm never reaches Adam
            grad_norm = nan_guard.finite_grad_norm(self.optimizer, loss)
            if not self._finite_step(grad_norm is not None):
                self.timers("optimizer").stop()
                self.iteration += 1  # the batch is consumed; weights and optimizer stay as they were
                self.consumed_samples += self.cfg.training.global_batch_size
                return loss, None
            ok = nan_guard.step_with_norm(self.optimizer, grad_norm)
        else:
            ok, grad_norm, _ = self.optimizer.step()
        self.timers("optimizer").stop()
        if ok:
            self.scheduler.step(increment=1)
            if self.ema is not None:
                self.ema.update()
        self.iteration += 1
        self.consumed_samples += self.cfg.training.global_batch_size
        return loss, grad_norm

    def _finite_step(self, finite: bool) -> bool:
        """--check-for-nan-in-loss-and-grad: count this iteration; a skipped one is logged, and K
        in a row stop the run after a save of the last good state."""
        stop = self.nonfinite.record(finite)
        if not finite:
            self.logger.info(f"iteration {self.iteration + 1}: non-finite loss or gradient; step skipped "
                             f"({self.nonfinite.consecutive} in a row, {self.nonfinite.skipped} in this run)")
        if stop:
            self.iteration += 1
            self.consumed_samples += self.cfg.training.global_batch_size
            if self.cfg.checkpoint.save:
                self.save()
            self._wait_for_saves()
            self.profiler.stop()
            self.logger.close()
            kept = (f"the last good weights and optimizer state are saved at iteration {self.iteration}"
                    if self.cfg.checkpoint.save else "nothing saved (no --save)")
            raise nan_guard.NonFiniteStop(
                f"{self.nonfinite.consecutive} consecutive iterations with a non-finite loss or gradient "
                f"(up to iteration {self.iteration}, --max-consecutive-nonfinite-iters "
                f"{self.cfg.training.max_consecutive_nonfinite_iters}); {kept}")
        return finite

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation NELBO per token (exact NLL for AR) over --eval-iters global batches."""
        for chunk in self.model:
            chunk.eval()
        total = []
        for i in range(self.cfg.logging.eval_iters):
            loss = self._run_schedule(self.valid_batches, i * self.cfg.training.global_batch_size, training=False)
            total.append(loss)
        return None if total[0] is None else sum(total) / len(total)

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        cfg, t, log, ckpt = self.cfg, self.cfg.training, self.cfg.logging, self.cfg.checkpoint
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        seq, gbs, iters = cfg.model.seq_length, t.global_batch_size, t.train_iters
        self.logger.info(f"family {self.family.name} (loss {self.family.loss_type}) | preset {cfg.model.preset} | "
                         f"vocab {self.arch.vocab_size} (padded {self.arch.padded_vocab_size(tp)}) | "
                         f"TP {tp} PP {pp} DP {parallel_state.get_data_parallel_world_size()} | "
                         f"device {platform.device()} | layers {self.layer_impl} | "
                         f"{iters} iterations of {gbs} x {seq} tokens | "
                         f"{iters * gbs * self.budget_flops_per_seq:.4g} training FLOPs ({t.flops_convention})")
        if ckpt.save:
            line, each = self._disk_estimate()  # collective
            self.logger.info(line)
            checkpoint.store.check_free_space(ckpt.save, each)
        if self.iteration >= iters:  # loaded a checkpoint at (or past) the end: evaluate only
            self.logger.info(f"iteration {self.iteration} already reaches --train-iters {iters}: evaluating only")
            self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops(), self.consumed_samples)
            self.logger.close()
            return
        last = self.iteration
        tick = loop_start = time.perf_counter()
        first = self.iteration
        saved_at = None
        while self.iteration < iters:
            self.profiler.before_iteration(self.iteration + 1)
            if self.async_queue is not None:
                checkpoint.store.finalize_saves(ckpt.save, self.async_queue, blocking=False)
            loss, grad_norm = self.train_step()
            if (mean := self.spikes.check(loss)) is not None:
                self.logger.info(f"loss spike at iteration {self.iteration}: {loss:.4f} is over "
                                 f"{t.loss_spike_factor:g} x the recent mean {mean:.4f}")
            if self.iteration % log.log_interval == 0 or self.iteration == iters:
                platform.synchronize()
                elapsed = time.perf_counter() - tick
                steps = self.iteration - last
                tokens_per_s = steps * gbs * seq / elapsed
                tflops = steps * gbs * self.flops_per_seq / elapsed / 1e12 / dist.get_world_size()
                eta = (time.perf_counter() - loop_start) / (self.iteration - first) * (iters - self.iteration)
                text, extra, scalars = self._observations(steps, elapsed, tflops, eta)
                self.logger.train(self.iteration, iters, loss, self.optimizer.param_groups[0]["lr"],
                                  grad_norm, tokens_per_s, tflops, self.consumed_samples, self.cumulative_flops(),
                                  extra_text=text, extra=extra, scalars=scalars)
                last, tick = self.iteration, time.perf_counter()
            if log.eval_interval and (self.iteration % log.eval_interval == 0 or self.iteration == iters):
                self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops(), self.consumed_samples)
                observability.phase_times(self.timers, 1)  # validation's schedule time is not training's
                tick = time.perf_counter()
            if ckpt.save and ckpt.save_interval and self.iteration % ckpt.save_interval == 0:
                self.save()
                saved_at, tick = self.iteration, time.perf_counter()
            reason = self.exits.reason(self.iteration)
            if reason is not None:
                self.logger.info(f"exiting after iteration {self.iteration}: {reason}")
                break
        self.profiler.stop()
        if ckpt.save and saved_at != self.iteration:
            self.save()
        self._wait_for_saves()
        checkpoint.store.release_save_lock()  # every save, background ones too, is complete
        self.logger.close()

    def cumulative_flops(self) -> int:
        """Training FLOPs so far (--flops-convention), from the consumed samples so resumes continue."""
        return self.consumed_samples * self.budget_flops_per_seq

    def save(self) -> None:
        if self.async_queue is not None:  # one save in flight at a time: bounded host memory
            checkpoint.store.finalize_saves(self.cfg.checkpoint.save, self.async_queue, blocking=True)
        start = time.perf_counter()
        path = training_state.save_checkpoint(
            self.cfg.checkpoint.save, self.iteration, self.model, self.optimizer, self.scheduler,
            {"consumed_samples": self.consumed_samples, "identity": self.identity().as_dict(),
             "data_mix": self.cfg.data.data_path, "data_mix_start": self.train_batches.data_offset,
             # what sampling/evaluation need to rebuild the model and decode text (not checked on load)
             "seq_length": self.cfg.model.seq_length,
             "tokenizer": self.tokenizer_record},
            ema=self.ema, async_queue=self.async_queue, on_complete=self._saved,
        )
        if self.async_queue is not None:
            self.logger.info(f"writing checkpoint {path} in the background (training paused "
                             f"{time.perf_counter() - start:.2f} s)")

    def _saved(self, path: str) -> None:
        """After a save is complete (renamed into place and tracked): log it, apply retention."""
        self.logger.info(f"saved checkpoint {path}")
        ckpt = self.cfg.checkpoint
        if not self.config_beside_checkpoints:
            self.config_beside_checkpoints = True
            self._write_resolved_config(ckpt.save)
        if ckpt.keep_last_n_checkpoints:
            checkpoint.store.apply_retention(ckpt.save, ckpt.keep_last_n_checkpoints, ckpt.keep_checkpoint_interval,
                                             log=self.logger.info)

    def _write_resolved_config(self, directory: str | None) -> None:
        if directory and self.logger.active:
            for path in write_resolved(self.cfg, [directory], dist.get_world_size()):
                self.logger.info(f"wrote the resolved configuration {path}")

    def _wait_for_saves(self) -> None:
        if self.async_queue is not None:
            checkpoint.store.finalize_saves(self.cfg.checkpoint.save, self.async_queue, blocking=True)

    # ------------------------------------------------------------------ cluster features

    def _start_cluster_features(self) -> None:
        """Exit conditions, numerical guards, async saves, profiler, MFU, W&B, resolved config."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        cfg, t, log = self.cfg, self.cfg.training, self.cfg.logging
        self.exits = ExitConditions(t)
        self.nonfinite = nan_guard.NonFiniteCounter(t.max_consecutive_nonfinite_iters)
        self.spikes = nan_guard.LossSpikes(t.loss_spike_factor)
        self.profiler = observability.Profiler(log)
        self.async_queue = AsyncCallsQueue() if cfg.checkpoint.async_save else None
        self.peak_flops, peak_source = observability.peak_flops(log.peak_flops, cfg.precision.fp8_format is not None)
        self.logger.info(f"MFU against {peak_source}")
        # Beside the logs now; beside the checkpoints with the first save, so a run that only loads,
        # evaluates or fails leaves --save as it found it (the run that saved there keeps its record).
        self.config_beside_checkpoints = False
        self._write_resolved_config(log.tensorboard_dir)
        if log.wandb_project:
            if importlib.util.find_spec("wandb") is None:  # checked on every rank: none waits for another
                raise ValueError("--wandb-project needs the wandb package (pip install -e '.[wandb]')")
            if self.logger.active:
                default = os.path.join(cfg.checkpoint.save or log.tensorboard_dir or ".", "wandb")
                self.logger.add_writer(observability.WandbWriter(log, resolved_dict(cfg), default))

    def _disk_estimate(self) -> tuple[str, int]:
        """The start-of-run line on checkpoint size and the disk this run's checkpoints need, and
        the estimated bytes of one checkpoint."""
        ckpt, t = self.cfg.checkpoint, self.cfg.training
        params = self._checkpointed_parameters()
        each = retention.bytes_per_checkpoint(params, self.config.bf16, self.ema is not None)
        count = retention.checkpoints_on_disk(t.train_iters, self.iteration, ckpt.save_interval,
                                              ckpt.keep_last_n_checkpoints, ckpt.keep_checkpoint_interval)
        free = shutil.disk_usage(ckpt.save).free
        line = (f"checkpoints: about {each / 2**30:.3g} GiB each ({params:,} parameters); up to {count} in "
                f"{ckpt.save} at once -> about {count * each / 2**30:.3g} GiB ({free / 2**30:.4g} GiB free)")
        if count * each > free:
            line += "; NOT ENOUGH DISK for all of them: set --keep-last-n-checkpoints"
        return line, each

    def _checkpointed_parameters(self) -> int:
        """Elements of every tensor a checkpoint holds for the model, whatever the layout: the
        global shapes of the sharded state, gathered over all ranks (collective)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        local = {sh.key: math.prod(sh.global_shape) for chunk in self.model
                 for sh in chunk.module.sharded_state_dict().values() if isinstance(sh, ShardedTensor)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sum({k: v for part in gathered for k, v in part.items()}.values())

    def _observations(self, steps: int, elapsed: float, tflops: float, eta: float) -> tuple[str, dict, dict]:
        """The log line's MFU, peak memory, phase times and ETA: (text, metrics-file values,
        TensorBoard/W&B scalars under Megatron-LM's names)."""
        phases = observability.phase_times(self.timers, steps)
        memory, measured = platform.peak_memory()
        mfu = tflops * 1e12 / self.peak_flops if self.peak_flops else None
        text = (f" | MFU {'n/a' if mfu is None else f'{mfu:.1%}'} | peak memory {memory / 2**30:.2f} GiB ({measured})"
                + (" | ms per iteration: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) if phases else "")
                + f" | ETA {observability.format_eta(eta)}")
        extra = {"mfu": mfu, "peak_memory_bytes": memory, "eta_seconds": eta,
                 **{f"{k}_ms": v for k, v in phases.items()}}
        scalars = {"iteration-time": elapsed / steps, "mem-max-allocated-bytes": memory, "mfu": mfu,
                   **{f"{observability.PHASES[k]}-time": v / 1000 for k, v in phases.items()}}
        return text, extra, scalars
