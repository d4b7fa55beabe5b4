"""The optimizer's kernels where megatron-core finds neither TransformerEngine nor Apex (as on CI):
gradient norm and clipping in torch's multi-tensor kernels, equal to the dense formulas, with one
host synchronisation per step whatever the depth; and torch's fused AdamW, taking the steps of
the torch AdamW megatron-core builds, with or without the distributed optimizer."""
import collections
import math

import pytest
import torch
from megatron.core.optimizer import clip_grads
from megatron.core.utils import local_multi_tensor_l2_norm
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dllm.config.optimizer import OptimizerConfig
from megatron_dllm.config.parallel import ParallelConfig
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.model.presets import Preset
from megatron_dllm.training.optim import build_optimizer, use_foreach_kernels, wrap_ddp

VOCAB, SEQ = 100, 16


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, distributed: bool):
    """A small DiT under megatron DDP and the optimizer `training.build` makes (clip 1.0)."""
    arch = Architecture(Preset(32, layers, 2), VOCAB, SEQ, "bidirectional")
    config, mlp_config = transformer_config(arch)
    parallel = ParallelConfig(use_distributed_optimizer=distributed)
    model = wrap_ddp(build_model(arch, config, mlp_config, seed=0), config, parallel)
    opt = OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    optimizer, _ = build_optimizer(model, config, opt, parallel, train_iters=100)
    return model, optimizer


def backward(model, seed: int) -> None:
    """Gradients into megatron's buffers, large enough that clipping scales them."""
    gen = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, VOCAB, (2, 2, SEQ), generator=gen)
    for chunk in model:
        chunk.zero_grad_buffer()
    logits = model[0](ids, torch.arange(SEQ).expand(2, SEQ), torch.zeros(2), None)  # [s, b, V]
    (1e3 * torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.t().flatten())).backward()


def test_gradient_norm_and_clipping_equal_the_dense_formulas(world_of_one):
    use_foreach_kernels()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in [(7, 5), (3,), (11, 2, 4), (1,)]]
    dense = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert clip_grads.get_grad_norm_fp32(grads) == pytest.approx(dense.item(), rel=1e-6)
    assert local_multi_tensor_l2_norm(0, None, [grads], False)[0].item() == pytest.approx(dense.item(), rel=1e-6)

    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=dense.item())
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * (1.0 / (dense.item() + 1e-6)))


def test_the_gradient_norm_of_an_embedding_sized_tensor_is_exact_on_cpu(world_of_one):
    """torch's CPU float32 norm sums in sequence: 1.6e-3 off at 30M elements (an embedding's
    gradient), enough to change clipping; the norm accumulates in float64 on the CPU."""
    use_foreach_kernels()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(30_000_000, generator=gen) * 1e-3, torch.randn(1000, generator=gen) * 1e-3]
    exact = [torch.linalg.vector_norm(g.double()).item() for g in grads]
    assert torch.linalg.vector_norm(grads[0]).item() != pytest.approx(exact[0], rel=1e-4)  # the sequential sum
    assert clip_grads.get_grad_norm_fp32(grads) == pytest.approx(math.hypot(*exact), rel=1e-7)


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
def test_an_optimizer_step_synchronises_with_the_host_once_whatever_the_depth(world_of_one, distributed):
    for layers in (1, 3):
        model, optimizer = build(layers, distributed)
        backward(model, seed=0)
        with OpCounter() as counter:
            optimizer.step()
        # megatron-core reads the total norm once, to decide on clipping; its own stand-ins read
        # every tensor's norm (a synchronisation per parameter on a GPU)
        assert counter.ops[torch.ops.aten._local_scalar_dense] == 1
        assert counter.ops[torch.ops.aten._fused_adamw_] >= 1 and not counter.ops[torch.ops.aten.addcdiv_]


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
def test_fused_adam_takes_the_steps_of_megatrons_torch_adamw(world_of_one, distributed):
    (model, fused), (reference_model, reference) = build(2, distributed), build(2, distributed)
    for opt in getattr(reference, "chained_optimizers", [reference]):
        for group in opt.optimizer.param_groups:
            group.update(fused=None, foreach=None)  # what megatron-core's torch AdamW has
    for step in range(3):  # the same gradients for both: only the kernels differ
        backward(reference_model, seed=step)
        for p, q in zip(model[0].parameters(), reference_model[0].parameters()):
            p.main_grad.copy_(q.main_grad)
        for opt in (fused, reference):
            ok, grad_norm, _ = opt.step()
            assert ok and grad_norm > 1.0  # clipped
    for p, q in zip(model[0].parameters(), reference_model[0].parameters()):
        torch.testing.assert_close(p, q)
    assert all(g["fused"] for g in fused.param_groups)
