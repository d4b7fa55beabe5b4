"""Fine-tuning losses of every family: the prompt is never corrupted and carries no loss, and the
mean loss equals a dense reference written from the clean tokens and the prompt mask (TP=1 here;
TP=2 on two gloo ranks in tests/sft_worker.py)."""

import pytest
import torch
from conftest import run_worker_on_two_ranks
from sft_cases import MASK, PROMPT_LENGTHS, dense_sft_loss, make_case

FAMILIES = ("ar", "mdlm", "duo", "esolm")


pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_is_never_corrupted_and_carries_no_loss(name):
    corrupted_response = 0
    for seed in range(6):
        family, tokens, prompt, inp, logits = make_case(name, seed)
        for row, p in enumerate(PROMPT_LENGTHS):
            if name == "ar":  # targets are x[1:]: the first p - 1 targets are prompt tokens
                assert inp.valid[row].tolist() == [0.0] * (p - 1) + [1.0] * (inp.valid.shape[1] - p + 1)
                continue
            if name == "esolm":  # the prompt is the clean prefix of the shuffled order, in order
                assert inp.position_ids[row, :p].tolist() == list(range(p))
                seen_tokens, seen_valid = inp.input_ids[row, :p], inp.valid[row, :p]
                assert inp.valid[row].sum() == len(tokens[row]) - p
            else:
                seen_tokens, seen_valid = inp.input_ids[row, :p], inp.valid[row, :p]
                assert inp.valid[row, p:].eq(1).all()
            assert torch.equal(seen_tokens, tokens[row, :p]) and seen_valid.eq(0).all()
            corrupted_response += int((inp.input_ids[row] != tokens[row]).sum()) if name != "esolm" else \
                int((inp.input_ids[row] == MASK).sum())
        per_token = family.loss(logits.clone(), inp)
        assert per_token[inp.valid == 0].eq(0).all()
    if name != "ar":
        assert corrupted_response > 20  # the response was noised (the test is not vacuous)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("t_value", [None, 0.9])
def test_loss_equals_dense_reference(name, t_value):
    family, tokens, prompt, inp, logits = make_case(name, seed=1, t_value=t_value)
    per_token = family.loss(logits.clone(), inp)
    got = per_token.double().sum() / inp.valid.sum()  # what the trainer reduces to
    ref = dense_sft_loss(name, tokens, prompt, inp, logits)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert family.nelbo(logits.clone(), inp).double().sum().item() / inp.valid.sum().item() == \
        pytest.approx(ref.item(), rel=1e-5)  # validation reports the same bound on response tokens


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_equals_dense_reference(tmp_path):
    result = run_worker_on_two_ranks("sft_worker.py", tmp_path, timeout=180)
    assert sorted(result) == sorted(FAMILIES)
    for name, r in result.items():
        assert r["rel_err"] <= 1e-5 and r["ranks_agree"] and r["prompt_grad_zero"], (name, r)


def test_validation_weighs_every_response_token_alike(monkeypatch):
    """Validation over --eval-iters global batches whose response tokens differ in number (prompts
    of different lengths): the NELBO per token over all of them, as tools/evaluate.py nelbo computes
    it, not a mean of the batches' means."""
    from types import SimpleNamespace

    from megatron_dllm.training import step
    from megatron_dllm.training.trainer import Trainer

    sums = iter([torch.tensor([100.0, 50.0], dtype=torch.float64), torch.tensor([10.0, 10.0], dtype=torch.float64)])
    monkeypatch.setattr(step, "loss_sums", lambda *args, **kwargs: next(sums))
    trainer = SimpleNamespace(model=[torch.nn.Linear(1, 1)], family=None, valid_batches=None,
                              meter=SimpleNamespace(timers=None),
                              config=SimpleNamespace(training=SimpleNamespace(global_batch_size=4),
                                                     logging=SimpleNamespace(eval_iters=2)))
    assert Trainer.evaluate(trainer) == pytest.approx(110 / 60)  # the batches' means: 2 and 1
