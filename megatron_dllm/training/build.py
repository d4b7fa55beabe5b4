"""What a run trains, built from its resolved and validated RunConfig (config/validate.py): the
family, the DiT chunks in megatron's DDP with their optimizer and LR schedule, and the
train/valid batch schedules. The trainer and
the benchmarks build through here, so both run the same model and optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from megatron_dllm.config import RunConfig
from megatron_dllm.families import get_family
from megatron_dllm.model.attention import resolve_backend
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.training.batches import BatchSchedule
from megatron_dllm.training.optim import build_optimizer, wrap_ddp


@dataclass
class TrainingModel:
    arch: Architecture
    config: TransformerConfig
    model: list  # DDP-wrapped chunks (one per virtual pipeline stage)
    optimizer: object
    scheduler: object
    layer_impl: str  # for the start-of-run line


def build_family(cfg: RunConfig, tokenizer):
    options = {"shift": True} if cfg.backbone.shift else {}
    return get_family(cfg.model.family, tokenizer.mask_id, tokenizer.vocab_size, cfg.model.loss,
                      **cfg.model.family_options(), **options)


def build_training_model(cfg: RunConfig, family, vocab_size: int, timers) -> TrainingModel:
    """The model chunks wrapped in DDP, megatron's optimizer and the LR schedule; `timers` are
    handed to megatron-core's schedules and gradient sync, which time themselves."""
    model_cfg, prec, par, t = cfg.model, cfg.precision, cfg.parallel, cfg.training
    arch = Architecture(cfg.preset(), vocab_size, model_cfg.seq_length, family.attention,
                        model_cfg.make_vocab_size_divisible_by, gpt=cfg.gpt_shape())
    use_te = model_cfg.uses_te()
    fusion = model_cfg.fusion(use_te)
    config, mlp_config = transformer_config(
        arch, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
        vpp=par.virtual_pipeline_model_parallel_size, sequence_parallel=par.sequence_parallel,
        bf16=prec.bf16, fp8=prec.fp8_format, fp8_recipe=prec.fp8_recipe,
        fp8_amax_history_len=prec.fp8_amax_history_len,
        fp8_amax_compute_algo=prec.fp8_amax_compute_algo, recompute=model_cfg.recompute(),
        variable_seq_lengths=cfg.data.variable_seq_length_prob > 0 and family.variable_length,
        fusion=fusion,
    )
    config.timers = timers
    attention = resolve_backend(model_cfg.attention_backend, use_te)
    chunks = build_model(arch, config, mlp_config, t.seed, use_te=use_te, attention_backend=attention)
    model = wrap_ddp(chunks, config, par)
    optimizer, scheduler = build_optimizer(model, config, cfg.optimizer, par, t.train_iters)
    layer_impl = (f"{'gpt backbone, ' if arch.gpt else ''}{'transformer_engine' if use_te else 'local'}, "
                  f"attention {attention}, {fusion.describe()}")
    return TrainingModel(arch, config, model, optimizer, scheduler, layer_impl)


def build_batches(cfg: RunConfig, family, inputs, sequence_parallel: bool) -> tuple[BatchSchedule, BatchSchedule]:
    """(train, valid) micro-batch schedules of this data-parallel rank."""
    t, tp = cfg.training, cfg.parallel.tensor_model_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train = BatchSchedule(inputs.train_dataset, family, t.seed, t.micro_batch_size, t.global_batch_size,
                          dp_rank, dp_size, variable_length_prob=cfg.data.variable_seq_length_prob,
                          length_multiple=tp if sequence_parallel else 1)
    # Validation draws fixed noise (its own seed stream) at full length so evaluations compare.
    valid = BatchSchedule(inputs.valid_dataset, family.evaluation(), t.seed + 1, t.micro_batch_size,
                          t.global_batch_size, dp_rank, dp_size)
    return train, valid
