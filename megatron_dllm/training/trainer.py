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
from megatron_dllm.checkpoint.tokenizer_record import check_tokenizer, tokenizer_record
from megatron_dllm.families import get_family
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.scaling.flops import train_flops_per_sequence
from megatron_dllm.training import checkpointing
from megatron_dllm.training.batches import BatchSchedule
from megatron_dllm.training.config import resolve_preset, resolve_run
from megatron_dllm.training.ema import EMA
from megatron_dllm.training.logger import Logger
from megatron_dllm.training.optim import build_optimizer, wrap_ddp


class Trainer:
    def __init__(self, args):
        platform.init_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                  args.virtual_pipeline_model_parallel_size, seed=args.seed)
        self.run = run = resolve_run(args)  # defaults, tokenizer, datasets, iterations
        if args.save:  # a run that cannot save fails now, not after its first save interval
            checkpoint.check_writable(args.save)
        tp = args.tensor_model_parallel_size
        if args.sequence_parallel and tp > 1 and args.seq_length % tp:
            raise ValueError(f"--seq-length {args.seq_length} must be a multiple of "
                             f"--tensor-model-parallel-size {tp} under --sequence-parallel")
        self.args, self.tokenizer = args, run.tokenizer
        self.tokenizer_record = tokenizer_record(args.tokenizer_type, args.tokenizer_model)
        self.family = get_family(args.family, run.tokenizer.mask_id, run.tokenizer.vocab_size, args.loss)
        preset = resolve_preset(args)
        self.arch = Architecture(preset, run.tokenizer.vocab_size, args.seq_length, self.family.attention,
                                 args.make_vocab_size_divisible_by)
        use_te = platform.HAS_TE if args.transformer_impl is None else args.transformer_impl == "transformer_engine"
        if (use_te or args.fp8_format) and not platform.HAS_TE:
            raise ValueError("--transformer-impl transformer_engine and --fp8-format need TransformerEngine "
                             "on a CUDA GPU (not found); use --transformer-impl local without FP8")
        self.config, mlp_config = transformer_config(
            self.arch, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
            vpp=args.virtual_pipeline_model_parallel_size, sequence_parallel=args.sequence_parallel,
            bf16=args.bf16, fp8=args.fp8_format, fp8_recipe=args.fp8_recipe,
            fp8_amax_history_len=args.fp8_amax_history_len,
            fp8_amax_compute_algo=args.fp8_amax_compute_algo, recompute=args.recompute_activations,
            variable_seq_lengths=args.variable_seq_length_prob > 0 and self.family.variable_length,
        )
        chunks = build_model(self.arch, self.config, mlp_config, args.seed, use_te=use_te)
        self.model = wrap_ddp(chunks, self.config, args)
        self.layer_impl = "transformer_engine" if use_te else "local"
        self.optimizer, self.scheduler = build_optimizer(self.model, self.config, args, run.train_iters)

        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        if args.global_batch_size % (args.micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp_size}")
        self.train_batches = BatchSchedule(
            run.train_dataset, self.family, args.seed, args.micro_batch_size, args.global_batch_size,
            dp_rank, dp_size, variable_length_prob=args.variable_seq_length_prob,
            length_multiple=args.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        # Validation draws fixed noise (its own seed stream) at full length so evaluations compare.
        self.valid_batches = BatchSchedule(run.valid_dataset, self.family, args.seed + 1,
                                           args.micro_batch_size, args.global_batch_size, dp_rank, dp_size)
        self.logger = Logger(args.tensorboard_dir, args.metrics_file)
        self.ema = EMA(self.model, args.ema_decay) if args.ema_decay is not None else None
        self.iteration, self.consumed_samples = 0, 0
        if args.save:
            checkpoint.remove_incomplete(args.save, log=self.logger.info)
        if args.load:
            self._load(args)
        vocab = run.tokenizer.vocab_size
        # TFLOP/s counts every matmul the hardware runs; the cumulative FLOPs use the budget's convention.
        self.flops_per_seq = train_flops_per_sequence(preset, vocab, args.seq_length, "full")
        self.budget_flops_per_seq = train_flops_per_sequence(preset, vocab, args.seq_length, args.flops_convention)

    def _load(self, args) -> None:
        found = checkpoint.locate(args.load, args.ckpt_step, log=self.logger.info)
        if found is None:
            if args.save and os.path.abspath(args.load) == os.path.abspath(args.save):  # the resume idiom
                self.logger.info(f"no checkpoint in {args.load}: starting from iteration 0")
                return
            what = "holds no checkpoint" if os.path.isdir(args.load) else "does not exist"
            raise checkpoint.CheckpointError(
                f"--load {args.load} {what} (expected {checkpoint.TRACKER} or iter_XXXXXXX directories, "
                f"or a checkpoint directory itself)")
        self.logger.info(f"loading {found.path} ({found.how})")
        common = checkpointing.load_checkpoint(
            found.path, self.model, self.optimizer, self.scheduler, self.identity(),
            load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, finetune=args.finetune,
            ema=self.ema, log=self.logger.info)
        check_tokenizer(common.get("tokenizer"), args.tokenizer_model, found.path)
        if not args.finetune:
            self.iteration, self.consumed_samples = common["iteration"], common["consumed_samples"]
            self.train_batches.data_offset = self._data_mix_start(common)

    def _data_mix_start(self, common: dict) -> int:
        """Where the current training mix started. Resuming with another --data-path (e.g. the
        phase-2 mix from a phase-1 checkpoint) starts the new mix at its first sample now."""
        start = common.get("data_mix_start", 0)
        if common.get("data_mix", self.args.data_path) != self.args.data_path:
            self.logger.info(f"data mix changed at iteration {self.iteration}: {common['data_mix']} -> "
                             f"{self.args.data_path}; reading the new mix from its first sample")
            start = self.consumed_samples
        return start

    def identity(self) -> dict:
        """What a checkpoint must match to be loaded into this run."""
        p = self.arch.preset
        return {"family": self.family.name, "hidden_size": p.hidden_size, "num_layers": p.num_layers,
                "num_attention_heads": p.num_attention_heads, "vocab_size": self.arch.vocab_size,
                "mask_id": self.family.mask_id}

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
            num_microbatches=batches.num_microbatches, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=not training,
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
        self.consumed_samples += self.args.global_batch_size
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation NELBO per token (exact NLL for AR) over --eval-iters global batches."""
        for chunk in self.model:
            chunk.eval()
        total = []
        for i in range(self.args.eval_iters):
            loss = self._run_schedule(self.valid_batches, i * self.args.global_batch_size, training=False)
            total.append(loss)
        return None if total[0] is None else sum(total) / len(total)

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        args, run = self.args, self.run
        self.logger.info(f"family {self.family.name} (loss {self.family.loss_type}) | preset {args.preset} | "
                         f"vocab {self.arch.vocab_size} (padded {self.arch.padded_vocab_size(args.tensor_model_parallel_size)}) | "
                         f"TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
                         f"DP {parallel_state.get_data_parallel_world_size()} | device {platform.device()} | "
                         f"layers {self.layer_impl} | "
                         f"{run.train_iters} iterations of {args.global_batch_size} x {args.seq_length} tokens | "
                         f"{run.train_iters * args.global_batch_size * self.budget_flops_per_seq:.4g} training FLOPs "
                         f"({args.flops_convention})")
        if self.iteration >= run.train_iters:  # loaded a checkpoint at (or past) the end: evaluate only
            self.logger.info(f"iteration {self.iteration} already reaches --train-iters {run.train_iters}: "
                             f"evaluating only")
            if args.eval_iters:
                self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops())
            self.logger.close()
            return
        last = self.iteration
        tick = time.perf_counter()
        while self.iteration < run.train_iters:
            loss, grad_norm = self.train_step()
            if self.iteration % args.log_interval == 0 or self.iteration == run.train_iters:
                platform.synchronize()
                elapsed = time.perf_counter() - tick
                steps = self.iteration - last
                tokens_per_s = steps * args.global_batch_size * args.seq_length / elapsed
                tflops = steps * args.global_batch_size * self.flops_per_seq / elapsed / 1e12 / dist.get_world_size()
                self.logger.train(self.iteration, run.train_iters, loss, self.optimizer.param_groups[0]["lr"],
                                  grad_norm, tokens_per_s, tflops, self.consumed_samples, self.cumulative_flops())
                last, tick = self.iteration, time.perf_counter()
            if args.eval_interval and (self.iteration % args.eval_interval == 0 or self.iteration == run.train_iters):
                self.logger.valid(self.iteration, self.evaluate(), self.cumulative_flops())
                tick = time.perf_counter()
            if args.save and args.save_interval and self.iteration % args.save_interval == 0:
                self.save()
                tick = time.perf_counter()
        if args.save and (not args.save_interval or self.iteration % args.save_interval):
            self.save()
        self.logger.close()

    def cumulative_flops(self) -> int:
        """Training FLOPs so far (--flops-convention), from the consumed samples so resumes continue."""
        return self.consumed_samples * self.budget_flops_per_seq

    def save(self) -> None:
        path = checkpointing.save_checkpoint(
            self.args.save, self.iteration, self.model, self.optimizer, self.scheduler,
            {"consumed_samples": self.consumed_samples, "identity": self.identity(),
             "data_mix": self.args.data_path, "data_mix_start": self.train_batches.data_offset,
             # what sampling/evaluation need to rebuild the model and decode text (not checked on load)
             "seq_length": self.args.seq_length,
             "tokenizer": self.tokenizer_record},
            ema=self.ema,
        )
        self.logger.info(f"saved checkpoint {path}")
