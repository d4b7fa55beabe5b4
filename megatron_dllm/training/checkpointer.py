"""A run's checkpoints: claiming --save, loading --load, saving every --save-interval iterations
and at the end (in the background under --async-save), retention, the resolved configuration
beside the checkpoints, and the start-of-run disk estimate. The checkpointer decides when to save.

    claim_save_dir(cfg.checkpoint)                      # before the model is built
    checkpointer = Checkpointer(cfg, model, ..., logger)
    iteration, consumed = checkpointer.load(...)
    checkpointer.poll()                                 # each iteration: finish background saves
    checkpointer.after_iteration(iteration, consumed, paused=meter.paused)
    checkpointer.finish(iteration, consumed)            # final save, wait, release --save
"""
from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import replace

import torch.distributed as dist

from megatron_dllm import checkpoint
from megatron_dllm.checkpoint import optimizer_settings, retention, training_state
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.load_plan import LoadPlan, plan_load
from megatron_dllm.checkpoint.meta import CheckpointMeta
from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord
from megatron_dllm.config import RunConfig
from megatron_dllm.config.checkpoint import CheckpointConfig
from megatron_dllm.config.yaml_config import write_resolved
from megatron_dllm.errors import InputError
from megatron_dllm.training.optim import fuse_adam


def claim_save_dir(ckpt: CheckpointConfig) -> None:
    """A run that cannot save fails now, not after its first save interval."""
    if not ckpt.save:
        return
    checkpoint.check_writable(ckpt.save)
    checkpoint.store.lock_save(ckpt.save)  # held until this process exits or finish()
    ckpt = starting_point(ckpt)
    # a run that does not resume --save would save over its checkpoints (a --load that names
    # nothing gets its own error from the load plan)
    elsewhere = ckpt.load and not checkpoint.layout.resumes(ckpt.load, ckpt.save)
    if not ckpt.load or ckpt.finetune or (elsewhere and checkpoint.store.holds_checkpoint(ckpt.load, ckpt.ckpt_step)):
        checkpoint.store.refuse_existing(ckpt.save, ckpt.load, ckpt.finetune)


def starting_point(ckpt: CheckpointConfig, log=None) -> CheckpointConfig:
    """`ckpt` with --pretrained-checkpoint resolved, as Megatron-LM does: while --load holds no
    checkpoint the run starts from the pretrained one as --finetune would; after its first save
    it resumes --load, so a requeued or relaunched command continues the run."""
    if ckpt.pretrained_checkpoint is None or checkpoint.store.holds_checkpoint(ckpt.load):
        return ckpt
    if log is not None:
        log(f"no checkpoint in --load {ckpt.load} yet: starting from --pretrained-checkpoint "
            f"{ckpt.pretrained_checkpoint} (weights only, as --finetune)")
    return replace(ckpt, load=ckpt.pretrained_checkpoint, finetune=True, pretrained_checkpoint=None)


def write_resolved_config(cfg: RunConfig, directory: str | None, logger) -> None:
    if directory and logger.active:
        for path in write_resolved(cfg, [directory], dist.get_world_size()):
            logger.info(f"wrote the resolved configuration {path}")


class Checkpointer:
    def __init__(self, cfg: RunConfig, model: list, optimizer, scheduler, ema, identity: ModelIdentity,
                 train_batches, logger):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.cfg, self.ckpt = cfg, cfg.checkpoint
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.identity, self.train_batches, self.logger = identity, train_batches, logger
        self.tokenizer_record = TokenizerRecord.of(cfg.tokenizer)
        self.async_queue = AsyncCallsQueue() if self.ckpt.async_save else None
        # Beside the checkpoints with the first save, so a run that only loads, evaluates or
        # fails leaves --save as it found it (the run that saved there keeps its record).
        self.config_written = False
        self.saved_at: int | None = None
        if self.ckpt.save:
            checkpoint.remove_incomplete(self.ckpt.save, log=logger.info)
            checkpoint.store.remove_leftover_removals(self.ckpt.save, log=logger.info)

    # ------------------------------------------------------------------ load

    def load(self) -> tuple[int, int]:
        """(iteration, consumed samples) to continue from: (0, 0) without --load, with --finetune,
        or when --load is --save and holds nothing yet (the resume idiom)."""
        with self._errors_name_the_flag_given():
            plan = self.plan()
            self._check_room(plan)
            if plan.path is not None:
                training_state.load_checkpoint(plan, self.model, self.optimizer, self.scheduler, self.ema,
                                               log=self.logger.info)
        if plan.path is None:
            for note in plan.notes:
                self.logger.info(note)
        elif plan.optimizer:
            fuse_adam(self.optimizer)
        self.train_batches.data_offset = plan.data_offset
        return plan.iteration, plan.consumed_samples

    @contextlib.contextmanager
    def _errors_name_the_flag_given(self):
        """A --pretrained-checkpoint started from stands in for --load: its errors name the flag
        the user gave."""
        load = starting_point(self.ckpt).load
        try:
            yield
        except InputError as err:
            if load == self.ckpt.load:
                raise
            raise type(err)(str(err).replace(f"--load {load}", f"--pretrained-checkpoint {load}")) from None

    def plan(self) -> LoadPlan:
        """What --load brings back, decided from the checkpoint's metadata (no tensor read yet)."""
        ckpt = starting_point(self.ckpt, log=self.logger.info)
        found = checkpoint.locate(ckpt.load, ckpt.ckpt_step, log=self.logger.info) if ckpt.load else None
        meta = None
        if found is not None:
            self.logger.info(f"loading {found.path} ({found.how})")
            meta = CheckpointMeta.read(found.path)
        run_settings = optimizer_settings.of_run(self.scheduler, self.optimizer) if self.optimizer is not None else None
        return plan_load(ckpt, found, meta, identity=self.identity, layout=training_state.parallel_layout(),
                         optimizer=self.optimizer is not None,
                         ema_decay=self.ema.decay if self.ema is not None else None,
                         data_path=self.cfg.data.data_path, tokenizer_model=self.cfg.tokenizer.tokenizer_model,
                         optimizer_settings=run_settings,
                         distributed_optimizer=self.cfg.parallel.use_distributed_optimizer)

    def _check_room(self, plan: LoadPlan) -> None:
        """The training set (sized --train-iters x --global-batch-size) holds the samples the rest
        of the run reads: a checkpoint consumed at a larger batch size would run out of them."""
        training = self.cfg.training
        needed = plan.consumed_samples - plan.data_offset + (training.train_iters - plan.iteration) * \
            training.global_batch_size
        held = len(self.train_batches.dataset)
        if plan.iteration < training.train_iters and needed > held:
            raise InputError(f"--load {plan.path}: {plan.consumed_samples} samples consumed by iteration "
                             f"{plan.iteration} and {training.train_iters - plan.iteration} more iterations of "
                             f"--global-batch-size {training.global_batch_size} need {needed} training samples; the "
                             f"training set holds {held} (built for --train-iters x --global-batch-size): resume "
                             f"with the checkpoint's --global-batch-size")

    # ------------------------------------------------------------------ cadence

    def poll(self) -> None:
        """Finish the background saves that are done (cheap when none is)."""
        if self.async_queue is not None:
            checkpoint.store.finalize_saves(self.ckpt.save, self.async_queue, blocking=False)

    def after_iteration(self, iteration: int, consumed: int, paused=contextlib.nullcontext) -> None:
        """Save when `iteration` is a multiple of --save-interval, inside `paused()` (the time
        training is paused for it)."""
        if self.ckpt.save and self.ckpt.save_interval and iteration % self.ckpt.save_interval == 0:
            with paused():
                self.save(iteration, consumed)

    def finish(self, iteration: int, consumed: int) -> None:
        """The end of training: save the last iteration unless it just was, wait for every
        background save, release --save."""
        if self.ckpt.save and self.saved_at != iteration:
            self.save(iteration, consumed)
        self.wait()
        checkpoint.store.release_save_lock()  # every save, background ones too, is complete

    # ------------------------------------------------------------------ save

    def save(self, iteration: int, consumed: int) -> None:
        if self.async_queue is not None:  # one save in flight at a time: bounded host memory
            checkpoint.store.finalize_saves(self.ckpt.save, self.async_queue, blocking=True)
        start = time.perf_counter()
        meta = CheckpointMeta(iteration, self.identity, consumed, seq_length=self.cfg.model.seq_length,
                              tokenizer=self.tokenizer_record, data_mix=self.cfg.data.data_path,
                              data_mix_start=self.train_batches.data_offset)
        path = training_state.save_checkpoint(self.ckpt.save, meta, self.model, self.optimizer, self.scheduler,
                                              ema=self.ema, async_queue=self.async_queue, on_complete=self._saved)
        self.saved_at = iteration
        if self.async_queue is not None:
            self.logger.info(f"writing checkpoint {path} in the background (training paused "
                             f"{time.perf_counter() - start:.2f} s)")

    def _saved(self, path: str) -> None:
        """After a save is complete (renamed into place and tracked): log it, apply retention."""
        self.logger.info(f"saved checkpoint {path}")
        ckpt = self.ckpt
        if not self.config_written:
            self.config_written = True
            write_resolved_config(self.cfg, ckpt.save, self.logger)
        if ckpt.keep_last_n_checkpoints:
            checkpoint.store.apply_retention(ckpt.save, ckpt.keep_last_n_checkpoints, ckpt.keep_checkpoint_interval,
                                             log=self.logger.info)

    def wait(self) -> None:
        if self.async_queue is not None:
            checkpoint.store.finalize_saves(self.ckpt.save, self.async_queue, blocking=True)

    # ------------------------------------------------------------------ disk

    def check_disk(self, iteration: int, bf16: bool) -> None:
        """Log checkpoint size and the disk this run's checkpoints need; fail now when --save
        cannot hold one more (collective)."""
        if not self.ckpt.save:
            return
        ckpt = self.ckpt
        params = self._checkpointed_parameters()
        each = retention.bytes_per_checkpoint(params, bf16, self.ema is not None)
        existing = list(checkpoint.layout.complete_checkpoints(ckpt.save))
        held, added = retention.checkpoints_on_disk(self.cfg.training.train_iters, iteration, ckpt.save_interval,
                                                    ckpt.keep_last_n_checkpoints, ckpt.keep_checkpoint_interval,
                                                    existing)
        if added == 0:  # it only evaluates: no save, no disk needed
            return
        free = shutil.disk_usage(ckpt.save).free
        line = (f"checkpoints: about {each / 2**30:.3g} GiB each ({params:,} parameters); up to {held} in "
                f"{ckpt.save} at once ({len(existing)} there now) -> about {added * each / 2**30:.3g} GiB more "
                f"({free / 2**30:.4g} GiB free)")
        if added * each > free:
            line += "; NOT ENOUGH DISK for all of them: set --keep-last-n-checkpoints"
        self.logger.info(line)
        checkpoint.store.check_free_space(ckpt.save, each)

    def _checkpointed_parameters(self) -> int:
        """Elements of every tensor a checkpoint holds for the model, whatever the layout: the
        global shapes of the sharded state, gathered over all ranks (collective)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        local = {}
        for chunk in self.model:
            state = chunk.module.sharded_state_dict()
            apply_factories(state)  # e.g. SwiGLU's fc1, saved as its two halves through a factory
            local.update({sh.key: math.prod(sh.global_shape) for sh in nested_values(state)
                          if isinstance(sh, ShardedTensor)})
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sum({k: v for part in gathered for k, v in part.items()}.values())
