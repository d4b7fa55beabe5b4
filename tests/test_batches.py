"""The micro-batch schedule: variable-length cuts and data-mix offsets, as pure functions; on a GPU,
the copy to the device that never makes the host wait."""
import numpy as np
import pytest
import torch

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.training import step
from megatron_dllm.training.batches import BatchSchedule


class Rows:
    """A dataset whose sample i is [i, i, ...]: shows which row a micro-batch read."""

    def __init__(self, n, length):
        self.n, self.length = n, length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.length, i, dtype=np.int64)


def _schedule(family="mdlm", prob=0.0, multiple=1, length=64):
    fam = get_family(family, mask_id=10**6, vocab_size=10**6 + 1)
    rows = Rows(100_000, length + int(fam.extra_token))
    return BatchSchedule(rows, fam, seed=1, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1,
                         variable_length_prob=prob, length_multiple=multiple)


def test_about_one_percent_of_micro_batches_are_cut():
    schedule = _schedule(prob=0.01)
    cuts = sum(schedule.cut_length(first, 64) < 64 for first in range(0, 40_000, 2))
    assert 150 <= cuts <= 260  # 20,000 draws at 1%: mean 200, sd 14


def test_cut_lengths_are_uniform_and_respect_the_tp_multiple():
    lengths = [_schedule(prob=1.0).cut_length(first, 64) for first in range(4000)]
    assert min(lengths) == 1 and max(lengths) == 64 and abs(np.mean(lengths) - 32.5) < 1.5
    even = [_schedule(prob=1.0, multiple=2).cut_length(first, 64) for first in range(500)]
    assert all(n % 2 == 0 and n >= 2 for n in even)


def test_cut_is_a_pure_function_and_shapes_the_model_input():
    a, b = _schedule(prob=1.0), _schedule(prob=1.0)
    first = a.micro_batch(consumed=80, m=1)
    assert torch.equal(first.input_ids, b.micro_batch(consumed=80, m=1).input_ids)
    length = a.cut_length(82, 64)
    assert first.input_ids.shape == (2, length) and first.valid.sum() == 2 * length


def test_a_cut_micro_batch_weighs_as_much_as_a_full_one():
    """As in the reference code, where each micro-batch's mean loss weighs alike: megatron-core's
    reduction (summed losses over summed counts) gives the mean of the micro-batch means, not a
    token-weighted mean that would all but drop the short micro-batches."""
    schedule = _schedule(prob=0.5)
    family = schedule.family
    inputs = [schedule.micro_batch(consumed=0, m=m) for m in range(40)]
    lengths = [inp.targets.shape[1] for inp in inputs]
    assert min(lengths) < 16 and max(lengths) == 64  # some cut well short, some whole
    gen = torch.Generator().manual_seed(0)
    per_token = [torch.rand(inp.targets.shape, generator=gen, dtype=torch.float64) + n / 64
                 for n, inp in zip(lengths, inputs)]  # short micro-batches have lower losses
    family.loss = lambda logits, inp: logits  # the "logits" here are the per-token losses
    outputs = [step.loss_func(family, True, 64, inp, loss) for inp, loss in zip(inputs, per_token)]
    totals, counts = zip(*[(total, count) for total, count, _ in outputs])
    assert all(count.dtype == torch.int and int(count) == 2 * 64 for count in counts)
    reduced = sum(totals) / sum(counts)
    assert float(reduced) == pytest.approx(float(torch.stack([loss.mean() for loss in per_token]).mean()), rel=1e-6)
    assert float(reduced) != pytest.approx(float(torch.cat([loss.flatten() for loss in per_token]).mean()),
                                           rel=1e-3)
    for (_, _, report), loss in zip(outputs, per_token):  # each mean as logged is its own
        assert float(report["loss"][0] / report["loss"][1]) == pytest.approx(float(loss.mean()), rel=1e-6)


def test_ar_is_never_cut():
    schedule = _schedule(family="ar", prob=1.0)
    assert schedule.micro_batch(consumed=0, m=0).input_ids.shape == (2, 64)


def test_a_new_mix_is_read_from_its_first_sample_with_global_noise():
    schedule = _schedule()
    before = schedule.micro_batch(consumed=800, m=0)
    schedule.data_offset = 800  # the mix switched at 800 consumed samples
    after = schedule.micro_batch(consumed=800, m=0)
    assert after.targets[:, 0].tolist() == [0, 1]  # rows 0 and 1 of the new mix
    assert before.targets[:, 0].tolist() == [800, 801]
    assert torch.equal(before.t, after.t)  # noise still follows the global sample index


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mdlm", "ar"])
def test_a_micro_batch_reaches_the_gpu_without_making_the_host_wait(family, monkeypatch):
    """A copy from pageable memory synchronises the stream (an error in this debug mode), so the
    GPU would idle while the host read and corrupted each micro-batch; the pinned copy is queued."""
    schedule = _schedule(family)
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = schedule.micro_batch(consumed=800, m=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(platform, "to_device", lambda tensor: tensor)
    on_host = schedule.micro_batch(consumed=800, m=1)
    for name, want in on_host.__dict__.items():
        got = getattr(on_gpu, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert got.is_cuda and torch.equal(got.cpu(), want), name
