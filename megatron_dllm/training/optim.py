"""Megatron DDP, optimizer (AdamW, optionally distributed) and LR/WD schedule."""
from __future__ import annotations

import torch
from megatron.core import utils as megatron_utils
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER, clip_grads, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import optimizer as megatron_optimizers
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dllm import platform
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


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's multi-tensor L2 norm (the norm of all tensors as one vector, shape [1]),
    left on the device: its stand-in without TE or Apex reads each tensor's norm to the host."""
    grads = tensor_lists[0]
    norms = torch._foreach_norm(grads, 2, dtype=platform.norm_dtype(grads[0].device) if grads else torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron-core's multi-tensor `dst = src * scale` (gradient clipping) as foreach kernels."""
    src, dst = tensor_lists
    if src is dst:
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_kernels() -> None:
    """Without TE or Apex, megatron-core norms and clips gradients one tensor at a time, with a
    host synchronisation per parameter; put torch's multi-tensor kernels in their place."""
    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
    for module in (clip_grads, megatron_optimizers):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _scale


def fuse_adam(optimizer) -> None:
    """torch's fused AdamW kernel where megatron-core fell back to torch's AdamW (no TE, no Apex):
    one pass over weights, gradients and moments per step instead of foreach's dozen. Apply again
    after loading a checkpoint: torch restores the saved param groups' choice of kernel."""
    if not USING_PYTORCH_OPTIMIZER:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = opt.optimizer
        if adam is None:
            continue
        for group in (adam.defaults, *adam.param_groups):
            group.update(fused=True, foreach=False)
        for param, state in adam.state.items():
            if "step" in state:  # the fused kernel reads the step count on the weights' device
                state["step"] = state["step"].to(param.device, torch.float32)


def build_optimizer(model, config, opt: OptimizerConfig, parallel: ParallelConfig, train_iters: int):
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    use_foreach_kernels()
    optimizer = get_megatron_optimizer(megatron_config, model, config_overrides=weight_decay_overrides(opt))
    fuse_adam(optimizer)
    warmup, decay = opt.warmup_iters(train_iters), opt.decay_iters(train_iters)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=train_iters, wd_incr_style="constant",
        wsd_decay_steps=opt.wsd_decay_iters(train_iters),
        lr_wsd_decay_style=opt.wsd_decay_style(),
    )
    return optimizer, scheduler
