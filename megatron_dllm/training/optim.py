"""Megatron DDP, optimizer (AdamW, optionally distributed) and LR/WD schedule."""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dllm.config.optimizer import OptimizerConfig
from megatron_dllm.config.parallel import ParallelConfig


def wrap_ddp(chunks, config, parallel: ParallelConfig):
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=parallel.overlap_grad_reduce,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    if parallel.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model]
        config.grad_sync_func = [m.start_grad_sync for m in model]
        if len(model) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    return model


def weight_decay_overrides(opt: OptimizerConfig):
    """megatron-core's per-parameter overrides: None keeps its standard groups (biases and 1-D
    parameters without weight decay); an empty dict decays every parameter, as the paper's code."""
    return {} if opt.apply_wd_to_all_params else None


def build_optimizer(model, config, opt: OptimizerConfig, parallel: ParallelConfig, train_iters: int):
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(megatron_config, model, config_overrides=weight_decay_overrides(opt))
    warmup, decay = opt.warmup_iters(train_iters), opt.lr_decay_iters or train_iters
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=train_iters, wd_incr_style="constant",
        wsd_decay_steps=opt.lr_wsd_decay_iters or max(1, train_iters // 3),
        lr_wsd_decay_style=opt.lr_wsd_decay_style,
    )
    return optimizer, scheduler
