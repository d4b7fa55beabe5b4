"""The training loop: megatron-core's schedules, DDP and optimizer around a family and the DiT.

    data -> BatchSchedule (family.corrupt) -> DiTModel -> family.loss -> forward_backward_func
         -> optimizer.step -> scheduler.step -> log / evaluate / save
"""
from __future__ import annotations

import os
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dllm import checkpoint, platform
from megatron_dllm.checkpoint import training_state
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.tokenizer_record import check_tokenizer, tokenizer_record
from megatron_dllm.config import RunConfig
from megatron_dllm.config.checkpoint import CheckpointConfig
from megatron_dllm.families import get_family
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.scaling.flops import train_flops_per_sequence
from megatron_dllm.training.batches import BatchSchedule
from megatron_dllm.training.ema import EMA
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
        self.config, mlp_config = transformer_config(
            self.arch, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
            vpp=par.virtual_pipeline_model_parallel_size, sequence_parallel=par.sequence_parallel,
            bf16=prec.bf16, fp8=prec.fp8_format, fp8_recipe=prec.fp8_recipe,
            fp8_amax_history_len=prec.fp8_amax_history_len,
            fp8_amax_compute_algo=prec.fp8_amax_compute_algo, recompute=model_cfg.recompute_activations,
            variable_seq_lengths=cfg.data.variable_seq_length_prob > 0 and self.family.variable_length,
        )
        chunks = build_model(self.arch, self.config, mlp_config, t.seed, use_te=use_te)
        self.model = wrap_ddp(chunks, self.config, par)
        self.layer_impl = "transformer_engine" if use_te else "local"
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
        self.ema = EMA(self.model, t.ema_decay) if t.ema_decay is not None else None
        self.iteration, self.consumed_samples = 0, 0
        if ckpt.save:
            checkpoint.remove_incomplete(ckpt.save, log=self.logger.info)
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
        inp = next(data_iterator)
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
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            if self.ema is not None:
                self.ema.update()
        self.iteration += 1
        self.consumed_samples += self.cfg.training.global_batch_size
        return loss, grad_norm

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
        if self.iteration >= iters:  # loaded a checkpoint at (or past) the end: evaluate only
            self.logger.info(f"iteration {self.iteration} already reaches --train-iters {iters}: evaluating only")
            self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops())
            self.logger.close()
            return
        last = self.iteration
        tick = time.perf_counter()
        while self.iteration < iters:
            loss, grad_norm = self.train_step()
            if self.iteration % log.log_interval == 0 or self.iteration == iters:
                platform.synchronize()
                elapsed = time.perf_counter() - tick
                steps = self.iteration - last
                tokens_per_s = steps * gbs * seq / elapsed
                tflops = steps * gbs * self.flops_per_seq / elapsed / 1e12 / dist.get_world_size()
                self.logger.train(self.iteration, iters, loss, self.optimizer.param_groups[0]["lr"],
                                  grad_norm, tokens_per_s, tflops, self.consumed_samples, self.cumulative_flops())
                last, tick = self.iteration, time.perf_counter()
            if log.eval_interval and (self.iteration % log.eval_interval == 0 or self.iteration == iters):
                self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops())
                tick = time.perf_counter()
            if ckpt.save and ckpt.save_interval and self.iteration % ckpt.save_interval == 0:
                self.save()
                tick = time.perf_counter()
        if ckpt.save and (not ckpt.save_interval or self.iteration % ckpt.save_interval):
            self.save()
        self.logger.close()

    def cumulative_flops(self) -> int:
        """Training FLOPs so far (--flops-convention), from the consumed samples so resumes continue."""
        return self.consumed_samples * self.budget_flops_per_seq

    def save(self) -> None:
        path = training_state.save_checkpoint(
            self.cfg.checkpoint.save, self.iteration, self.model, self.optimizer, self.scheduler,
            {"consumed_samples": self.consumed_samples, "identity": self.identity().as_dict(),
             "data_mix": self.cfg.data.data_path, "data_mix_start": self.train_batches.data_offset,
             # what sampling/evaluation need to rebuild the model and decode text (not checked on load)
             "seq_length": self.cfg.model.seq_length,
             "tokenizer": self.tokenizer_record},
            ema=self.ema,
        )
        self.logger.info(f"saved checkpoint {path}")
