"""--check-for-nan-in-loss-and-grad in process, on a real Trainer over the demo corpus: a step
whose total gradient norm is NaN or inf is skipped and counted, and leaves the weights and the
optimizer's state (Adam moments, step counts) bitwise as they were. That includes an overflow of
the norm itself: every gradient element finite, but their squared sum beyond float32's range."""
import pytest
import torch

from megatron_dllm import platform
from megatron_dllm.config import parse_args
from megatron_dllm.training import step
from megatron_dllm.training.trainer import Trainer

POISON = {"nan": float("nan"), "inf": float("inf"), "overflow": 1e25}  # 1e25 squared overflows float32


@pytest.fixture(scope="module", params=["adam", "distributed-adam"])
def trainer(request, demo_cache, tmp_path_factory):
    work = tmp_path_factory.mktemp("nonfinite")
    cfg = parse_args(["--demo-cache-dir", demo_cache, "--preset", "cpu-micro", "--seq-length", "32",
                      "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20",
                      "--lr-warmup-iters", "0", "--check-for-nan-in-loss-and-grad",
                      "--save", str(work / "ckpt"), "--tensorboard-dir", str(work / "tb")]
                     + (["--use-distributed-optimizer"] if request.param == "distributed-adam" else []))
    try:
        yield Trainer(cfg)
    finally:
        platform.destroy_distributed()


def _state(trainer) -> list:
    """Copies of the weights, every optimizer state tensor (exp_avg, exp_avg_sq, step) and the LR."""
    members = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [[p.detach().clone() for chunk in trainer.model for p in chunk.parameters()],
            [{k: v.clone() for k, v in state.items()} for m in members for state in m.optimizer.state.values()],
            trainer.optimizer.param_groups[0]["lr"]]


def _bitwise_equal(a, b) -> bool:
    if torch.is_tensor(a):  # compared as bytes: NaN == NaN, and -0.0 != 0.0
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["nan", "inf", "overflow"])
def test_a_step_with_a_non_finite_gradient_norm_is_skipped_and_leaves_the_optimizer_untouched(
        trainer, monkeypatch, kind):
    trainer.train_step()  # a good step first: Adam's moments and step counts exist
    loss_func = step.loss_func

    def poisoned(*args):  # every gradient of this step poisoned (args[-1]: the logits), the loss finite
        args[-1].register_hook(lambda grad: torch.full_like(grad, POISON[kind]))
        return loss_func(*args)

    monkeypatch.setattr(step, "loss_func", poisoned)
    before, skipped, iteration = _state(trainer), trainer.nonfinite.skipped, trainer.iteration
    loss, grad_norm = trainer.train_step()
    if kind == "overflow":  # the elements were finite: only their norm is not
        assert all(torch.isfinite(b.grad_data).all() for chunk in trainer.model for b in chunk.buffers)
    assert _bitwise_equal(_state(trainer), before)  # weights, Adam's moments and steps, the LR
    assert trainer.nonfinite.skipped == skipped + 1 and trainer.iteration == iteration + 1
    assert grad_norm is None
    monkeypatch.setattr(step, "loss_func", loss_func)
    _, grad_norm = trainer.train_step()  # and the next good step steps again
    assert grad_norm is not None and grad_norm == grad_norm and trainer.nonfinite.consecutive == 0
    assert not _bitwise_equal(_state(trainer), before)
