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
from megatron_dllm.training.attention_anneal import AttentionAnneal
from megatron_dllm.training.batches import BatchSchedule
from megatron_dllm.training.cuda_graph import FullIterationGraph
from megatron_dllm.training.optim import build_optimizer, wrap_ddp


@dataclass
class TrainingModel:
    arch: Architecture
    transformer_config: TransformerConfig
    model: list  # DDP-wrapped chunks (one per virtual pipeline stage)
    optimizer: object
    scheduler: object
    layer_impl: str  # for the start-of-run line
    graph: FullIterationGraph | None = None  # --cuda-graph-scope full_iteration


def build_family(config: RunConfig, tokenizer):
    options = {"shift": True} if config.backbone.shift else {}
    return get_family(config.model.family, tokenizer.mask_id, tokenizer.vocab_size, config.model.loss,
                      **config.model.family_options(), **options)


def build_training_model(config: RunConfig, family, vocab_size: int, timers) -> TrainingModel:
    """The model chunks wrapped in DDP, megatron's optimizer and the LR schedule; `timers` are
    handed to megatron-core's schedules and gradient sync, which time themselves."""
    model, precision, parallel = config.model, config.precision, config.parallel
    arch = Architecture(config.preset(), vocab_size, model.seq_length, family.attention,
                        model.make_vocab_size_divisible_by, gpt=config.gpt_shape())
    use_te = model.uses_te()
    fusion = model.fusion(use_te).for_backbone(arch.gpt)
    block_config, mlp_config = transformer_config(
        arch, tp=parallel.tensor_model_parallel_size, pp=parallel.pipeline_model_parallel_size,
        vpp=parallel.virtual_pipeline_model_parallel_size, sequence_parallel=parallel.sequence_parallel,
        bf16=precision.bf16, fp8=precision.fp8_format, fp8_recipe=precision.fp8_recipe,
        fp8_amax_history_len=precision.fp8_amax_history_len,
        fp8_amax_compute_algo=precision.fp8_amax_compute_algo, recompute=model.recompute(),
        variable_seq_lengths=config.data.variable_seq_length_prob > 0 and family.variable_length,
        fusion=fusion,
    )
    block_config.timers = timers
    # megatron-core's default puts a barrier at each level-1 timer's start and stop, and a barrier
    # waits for the device, which the phase timers no longer do (observability.EventTimer).
    # Megatron-LM's default --timing-log-level 0 has neither.
    block_config.barrier_with_L1_time = False
    attention = resolve_backend(model.attention_backend, use_te)
    chunks = build_model(arch, block_config, mlp_config, config.training.seed, use_te=use_te,
                         attention_backend=attention)
    ddp_chunks = wrap_ddp(chunks, block_config, parallel)
    optimizer, scheduler = build_optimizer(ddp_chunks, block_config, config.optimizer, parallel,
                                           config.training.train_iters)
    anneal = model.attention_mask_anneal_iters
    annealed = f" (causal to bidirectional over {anneal} iterations)" if anneal else ""
    layer_impl = (f"{'gpt backbone, ' if arch.gpt else ''}{'transformer_engine' if use_te else 'local'}, "
                  f"attention {attention}{annealed}, {model.describe_recompute()}, {fusion.describe()}")
    graph = None
    if model.cuda_graph_impl != "none":  # validated: local, full_iteration
        graph = FullIterationGraph(block_config, model.cuda_graph_warmup_steps)
        layer_impl += f", full-iteration CUDA graph after {model.cuda_graph_warmup_steps} eager iterations"
    return TrainingModel(arch, block_config, ddp_chunks, optimizer, scheduler, layer_impl, graph)


def build_batches(config: RunConfig, family, inputs, sequence_parallel: bool) -> tuple[BatchSchedule, BatchSchedule]:
    """(train, valid) micro-batch schedules of this data-parallel rank."""
    training, tp = config.training, config.parallel.tensor_model_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    anneal_iters = config.model.attention_mask_anneal_iters
    train = BatchSchedule(inputs.train_dataset, family, training.seed, training.micro_batch_size,
                          training.global_batch_size, dp_rank, dp_size,
                          variable_length_prob=config.data.variable_seq_length_prob,
                          length_multiple=tp if sequence_parallel else 1,
                          attention_anneal=AttentionAnneal(anneal_iters, training.seed) if anneal_iters else None)
    # Validation draws fixed noise (its own seed stream) at full length, with the family's own
    # attention (never annealed), so evaluations compare.
    valid = BatchSchedule(inputs.valid_dataset, family.evaluation(), training.seed + 1, training.micro_batch_size,
                          training.global_batch_size, dp_rank, dp_size)
    return train, valid
